"""The engine pool: persistent engines that hot-reload and measure candidates."""
