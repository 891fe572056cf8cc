"""The names a user may choose from, kept free of torch so that the CLI can list them (``--help``,
option validation) without paying for importing torch. The modules that implement them import
these tuples, so each name is written once."""

ALGORITHMS = ("ddp", "diloco", "streaming", "cocodc")
# the algorithms whose replicas average every step's gradients instead of syncing fragments of the
# model (``ReplicaStrategy.averages_gradients``): nothing overlaps, nothing is screened, and a run
# under way cannot take a new replica (there is no shared state beyond the replicas themselves)
AVERAGE_GRADIENTS = ("ddp",)
DC_RULES = ("tensor", "step")
CODEC_NAMES = ("fp32", "bf16", "int8", "fp4", "q2", "q1", "topk2", "topk4")
# the codecs too coarse to use without error feedback (2 bits or 1 a value, or most values dropped), so
# not for ddp's gradient average, which keeps none
NEEDS_FEEDBACK = ("q2", "q1", "topk2", "topk4")
# the codecs that send more bytes per value than q2, which --paced-codec auto sends instead of
# them while a slow link paces a cocodc swarm (fewer bytes a round, so more rounds through the link)
FINER_THAN_Q2 = ("fp32", "bf16", "int8", "fp4")
# the codec of outer gradients when --codec is not given: the fewest bytes at most 1 % above fp32's
# perplexity on the codec benchmark (chosen on sotu-before-1900, judged on sotu-from-1900 and
# web-bible: docs/codecs.md) and on the schedule of a `thin` run (a fragment synced every 192 steps:
# docs/performance.md). q2 meets the first at 564x fewer bytes than ddp, but ends 2.4 % behind fp32
# on the second; fp4 is level with fp32 on both
DEFAULT_CODEC = "fp4"
# a top-k codec's share of each chunk of 256 values when --topk is not given: of the shares measured
# on sotu-before-1900 (1/4, 1/8, 1/32), the one that sends fewer bytes than fp4 without falling far
# behind it (1/32: +81 % perplexity; docs/codecs.md)
DEFAULT_TOPK = 1 / 8
# how the owner of a butterfly slice combines its members' slices (algorithms/aggregation.py)
AGGREGATES = ("mean", "trimmed-mean", "centered-clip")
TOKENIZERS = ("bpe4096", "byte")
HF_PREFIX = "hf:"  # --model hf:PATH_OR_NAME: a Hugging Face causal LM (p2p_cocodc.models.hf)
PRECISIONS = ("fp32", "bf16")
COMPILE_BACKENDS = ("off", "inductor", "eager", "aot_eager")  # --compile: torch.compile's backends
LOG_SINKS = ("tensorboard", "wandb")  # --log-to: where run records also go (p2p_cocodc.ops.sinks)
