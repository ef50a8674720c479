"""One module per DAG stage: ``run(params, inputs, out) -> metrics`` and a thin ``main()`` for dvc.yaml.

``python -m stages.<stage>`` imports this package first: ``layout.preflight`` then refuses bad params or a
missing upstream input in one line, before the stage's own module (torch, transformers) is imported.
"""

from stages.layout import preflight

preflight()
