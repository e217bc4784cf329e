"""Fix profiles: small, anchored source fixes to an installed vLLM / vllm-gaudi, applied all or nothing.

`apply_all.py` is the command; `profile` reads the data files, `image` checks the installed trees,
`engine` plans and applies the fixes, `transaction` writes the files.
"""
