"""Running stage notebooks: discovering stages and recipes, the in-notebook stage API, the papermill runner with its cache, reports, hardware facts, and the `slm-bench` CLI."""
