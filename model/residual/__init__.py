"""Residual streams: the ResidualStream protocol with pre / post / deepnorm (stream.py), Attention
Residuals (attnres.py) and mHC hyper-connections (mhc.py, mhc_sinkhorn.py). See docs/architecture.md."""
