"""The port's switches (`switches`: the table and its one reader), the launches it refuses
(`guards`: one rule function per refusal) and what Beam's DFlash2 path does with each
--speculative-config key (`speculative_options`, the data rule `dflash2_options` reads). Plain
functions; nothing here imports vLLM or torch."""
