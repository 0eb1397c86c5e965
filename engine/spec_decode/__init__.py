"""Speculative decoding with the checkpoint's MTP layer: `mtp.MtpDrafter` proposes K draft
tokens per sequence; `acceptance` verifies them against the target's distributions."""
