"""smf: the Sparse Memory Finetuning experiment suite built on smf_kernels.

Layers, top to bottom; a module imports only from its own package or from a lower layer (packages side by side
do not import each other), and smf_kernels imports nothing of smf (tests/test_import_graph.py checks all of it):

1. ``smf.cli``: the ``smf`` command line;
2. ``smf.commands``: its subcommands (``smf train``, ``suite``, ``report``, ``eval``), one module each;
3. ``smf.suite``: Table 1 and the science presets: plan, run, record, and the suite directory's report;
4. ``smf.train`` (retrofit, background, train, pretrain), ``smf.eval`` (the evaluations of one model),
   ``smf.report`` (tables, figures, accounting, the check of a results record; nothing of a suite);
5. ``smf.model``: memories in a Hugging Face causal LM, freezing, adapters, loading;
6. ``smf.data``: loaders, formatting, tokenisation, the synthetic world;
7. ``smf.tiny`` (a CPU-sized preset of model and tokenizer), ``smf.options``, ``smf.threads``,
   ``smf.environment``, ``smf.files``, ``smf._lazy``;
8. ``smf.vocabulary``: the names every layer shares (conditions, tasks, metric keys, defaults);
9. ``smf.errors``.

Imports of smf modules inside functions only defer torch, transformers, matplotlib, the Qwen-2 model code or (from
``smf --help``) the suite config's schema, so that the parser and a config's checks stay light; the test lists each.
"""
