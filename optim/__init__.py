"""Optimizers (AdamW, Muon/MuonClip), parameter grouping and LR schedules (the optimizer issue)."""
