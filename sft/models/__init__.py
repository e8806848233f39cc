"""The architecture as we run it: transformers' model built on the meta device (`build`), the
mixture-of-experts routing and grouped experts (`moe`, `experts`), NF4 weights' matmuls (`nf4`),
layers that restart at document starts when packed (`packing`, `gated_deltanet`) and a
vision-language checkpoint's language model (`vision_language`). Imports nothing from the floors
above it (hub, adapters, parallel)."""
