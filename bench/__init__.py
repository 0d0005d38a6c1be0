"""bench/: the benchmark CLIs and what only they use.

`cells` (arms x seeds x depths request cells: JSONL, a markdown table, verdicts, the prefill cache the cells
share), `step` (decode step time against ring capacity and depth), `kernels` (the quantized kernels' weight-byte
bandwidth and the launch floor), `attention` (decode attention kernel variants), `round_model` (the bytes one MTP
round reads) and `provenance` (commit and device of a record). Tuning reaches the product code as arguments.
"""
