"""The ``p2p-cocodc`` command line."""
