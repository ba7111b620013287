"""What a plan costs before launch. ``hardware.py`` holds the accelerator profiles, the one place their peak
FLOPs, memory and bandwidths are written down: the training metrics' MFU reads them, and so will the planner.
"""
