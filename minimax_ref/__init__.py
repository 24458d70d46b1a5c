"""minimax-ref: a readable pure-PyTorch reference inference engine for MiniMax-M3 (minimax_m3_vl)."""
