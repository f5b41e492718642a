"""Lightning callbacks of lightning_sync, one module each; the public names are exported by ``lightning_sync``."""
