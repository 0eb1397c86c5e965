from engine.quant.base import QuantConfig, WeightFormat
from engine.quant.unquantized import NoQuant, Unquantized

__all__ = ["NoQuant", "QuantConfig", "Unquantized", "WeightFormat"]
