"""Command-line options of the smallest real runs the tests make: seconds each, still learning."""

# a 0.1 M-parameter GPT on bytes of the embedded corpus
TINY_MODEL = ["--model", "nano", "--tokenizer", "byte", "--seq-len", "32", "--batch-size", "4"]
# two fragments, each synced every 8 steps and applied 2 steps later; θ̄ evaluated every 8 steps
TINY_SYNCS = [
    "--inner-steps",
    "8",
    "--fragments",
    "2",
    "--overlap",
    "2",
    "--eval-every",
    "8",
    "--eval-batches",
    "2",
]
# two peers (or workers) of 24 steps on one thread each, quiet
TWO_PEERS = [*TINY_MODEL, "--workers", "2", "--steps", "24", *TINY_SYNCS, "--threads", "1", "--quiet"]

# three peers of 32 steps, the real-process swarm tests' common options
TINY = [
    *TINY_MODEL,
    "--workers",
    "3",
    "--steps",
    "32",
    *TINY_SYNCS,
    "--threads",
    "1",
    "--codec",
    "fp32",
    "--quiet",
]

# the same runs as TrainConfig fields, for the simulator (workers, steps and evaluation left to the caller)
TINY_FIELDS = {
    "model": "nano",
    "tokenizer": "byte",
    "seq_len": 32,
    "batch_size": 4,
    "inner_steps": 8,
    "fragments": 2,
    "overlap": 2,
    "eval_batches": 2,
    "threads": 1,
}
