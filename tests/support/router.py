"""The installed vllm-router's own --help: the flags and policies it accepts, which the replicas'
command lines must stay within."""
import subprocess

from beam_hpu.replicas.layout import router_executable


def router_help() -> str:
    return subprocess.run([router_executable(), "--help"], capture_output=True, text=True, check=True).stdout
