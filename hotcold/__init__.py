"""hotcold: hybrid GPU/CPU inference that keeps hot neurons on the GPU and cold ones on the CPU."""

__version__ = "0.1.0"
