"""What the plugin refuses or neutralises before it serves: launch guards, FP8 checkpoint checks, untrusted chat text."""
