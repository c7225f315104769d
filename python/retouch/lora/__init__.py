"""Per-request LoRA (SwiftDiffusion §3.2, §4.2; Punica's SGMV): adapters read from a local folder, kept in
an LRU host cache, loaded while their request already denoises, and applied unmerged per row, so that a
continuous batch mixes requests with different adapters (or none) in one forward."""

from retouch.lora.spec import MAX_PER_REQUEST, LoraChoice, LoraError, LoraUse, choice_header, parse_lora

__all__ = ["MAX_PER_REQUEST", "LoraChoice", "LoraError", "LoraUse", "choice_header", "parse_lora"]
