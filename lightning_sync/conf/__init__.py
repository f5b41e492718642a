"""Hydra configs of lsync-train (a package so they ship in the wheel and resolve via pkg://)."""
