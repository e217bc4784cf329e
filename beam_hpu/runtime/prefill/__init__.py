"""Prefill: bounded FusedSDPA with cached context, decodes kept in flight during long prompts."""
