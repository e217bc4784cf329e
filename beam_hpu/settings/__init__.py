"""The port's switches (`switches`: the table and its one reader) and the launches it refuses
(`guards`: one rule function per refusal). Plain functions; nothing here imports vLLM or torch."""
