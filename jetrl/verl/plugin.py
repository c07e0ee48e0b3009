"""Registers jetrl's verl engine (vendor ``jetrl``) and rollout (name ``jetrl_vllm``) with verl.

This module is what verl imports in each process that builds an engine or a rollout, via
``actor_rollout_ref.model.external_lib=jetrl.verl.plugin`` and ``VERL_USE_EXTERNAL_MODULES``
(both set by ``python -m jetrl.verl``). Registering adds entries under jetrl's own keys; it replaces
none of verl's, and stock runs (no ``VERL_ENGINE_VENDOR=jetrl``, rollout ``vllm``) are unaffected.
"""

from jetrl.verl.engine import register_engine
from jetrl.verl.worker import register_rollout

register_engine()
register_rollout()
