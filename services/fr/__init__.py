"""PyTorch Flight Recorder dumps: read without torch, judged, loaded into rankscope."""
