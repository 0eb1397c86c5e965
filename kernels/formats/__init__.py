"""Pure functions over the stored weight formats (no engine imports): FP8 E4M3 with block
scales and MXFP4 (E2M1 nibbles + E8M0 scales). Quantize, dequantize, pack and unpack, so
the engine's formats, the checkpoint maker and the kernels' references agree bit for bit."""
