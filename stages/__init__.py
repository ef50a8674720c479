"""One module per DAG stage: ``run(params, inputs, out) -> metrics`` and a thin ``main()`` for dvc.yaml."""
