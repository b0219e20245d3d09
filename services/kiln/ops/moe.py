"""``moe``: the mixture-of-experts feed-forward slot (Qwen3-MoE, Mixtral, DeepSeek-V3).

Call contract (for the implementations to come): ``moe(x[B,T,H]) -> [B,T,H]`` in the model
dtype, with params the router weight ``[E, H]``, the experts' gate/up/down weights (stacked
``[E, I, H]``/``[E, I, H]``/``[E, H, I]``), ``top_k``, ``norm_topk_prob`` and any shared experts.
It takes the place of ``mlp`` in a layer's ``ffn`` slot, so the decoder's forward does not change.
No implementation is registered yet; building an MoE model raises
:class:`kiln.workloads.models.build.UnbuildableModelError`.
"""
