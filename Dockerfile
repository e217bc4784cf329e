# The beam-1-0 port image: the stock vllm-gaudi releases/v0.30.0 image plus this repository.
#
#   docker build -f ports/beam-1-0/Dockerfile --build-arg BASE=<your-vllm-gaudi-v0.30.0-image> -t <your-beam-1-0-image> .
#
# The recipe's build steps, in order: copy the repository to /opt/gaudi-cookbook ($COOKBOOK), then
# ports/beam-1-0/install.sh checks the image commits, applies the v0.30.0 fix profile, (parser
# files: part of the plugin), patches the runner (port-beam-1-0), installs the beam_hpu plugin and
# runs the 8 build gates; any failure fails the build. Nothing else runs here, so nothing here can
# drift from what install.sh does outside Docker (tests/port/test_dockerfile.py keeps it so).
# The repository's top-level Dockerfile is this file, byte for byte.
ARG BASE
FROM ${BASE}
COPY . /opt/gaudi-cookbook
ENV COOKBOOK=/opt/gaudi-cookbook
RUN ["/bin/bash", "/opt/gaudi-cookbook/ports/beam-1-0/install.sh"]
