"""p2p-cocodc: decentralized low-communication training (DiLoCo, Streaming DiLoCo, CoCoDC)."""

__version__ = "0.1.0"
