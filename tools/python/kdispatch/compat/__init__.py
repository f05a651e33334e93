"""Drop-in modules with the function names, signatures and in-place/out
conventions of the kernel libraries serving stacks call, forwarding each
call to kdispatch's torch ops without copies or casts:

- ``kdispatch.compat.sgl_kernel``: SGLang's ``sgl_kernel``;
- ``kdispatch.compat.flashinfer``: FlashInfer's ``flashinfer`` (its ``norm``,
  ``activation`` and ``rope`` functions);
- ``kdispatch.compat.vllm``: vLLM's ``vllm._custom_ops``.

Code written against one of them changes its import, e.g.
``import kdispatch.compat.sgl_kernel as sgl_kernel``. An argument kdispatch
cannot serve as given (a dtype, a layout, an option it does not have)
raises ``kdispatch.CallError`` (KD-E030) naming the function and the
argument; nothing is copied or cast silently. The modules import torch and
``kdispatch.torch`` when imported.
"""
