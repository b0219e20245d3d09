"""Deployments: continual compilation (docs/design/deployments.md). The servicer
(:mod:`.service`), the controllers that run them (:mod:`.host`, :mod:`.controller`), and their
pieces: the traffic feed, window tracking, drift decisions, recompilation and promotion."""
