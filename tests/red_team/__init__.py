"""Red-team candidates the engine's gate is tested against: :mod:`.cheats` (with their code in
:mod:`.cheat_code`) on any model, :mod:`.moe` on mixture-of-experts models. Test fixtures, never
imported by the services."""
