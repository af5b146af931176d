"""lowprec inside the trainers people use: thin adapters over :mod:`lowprec.recipes`.

Each adapter is an optional extra and is imported on its own (this package imports none):

* :mod:`lowprec.integrations.transformers`: ``make_trainer``, an HF ``Trainer`` that trains
  with a recipe (``pip install 'lowprec[hf]'``);
* :mod:`lowprec.integrations.accelerate`: ``prepare(accelerator, model, optimizer, recipe)``
  for a loop of your own under ``accelerate`` (``lowprec[hf]``);
* :mod:`lowprec.integrations.lightning`: ``LowprecPrecision``, a Lightning precision plugin,
  and its Fabric twin (``lowprec[lightning]``);
* :mod:`lowprec.integrations.torchtitan`: a model converter registered by name;
* :mod:`lowprec.integrations.common`: what they share (module filters, weight-decay groups,
  lowprec's own checkpoint state).

``docs/integrations.md`` has a runnable example per trainer.
"""
