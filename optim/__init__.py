"""Optimizers (AdamW, Muon/MuonClip), parameter groups from the parameters' roles, QK-clip, and
the learning-rate / Muon-momentum schedules."""
