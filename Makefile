.PHONY: serve serve-standalone test archive proto settings-table
serve:   ## set up and serve the embedded model with TorchServe
	scripts/serve.sh
serve-standalone: ## set up and serve the embedded model with `llm_api serve` (no TorchServe)
	scripts/serve_standalone.sh
test:    ## set up and run the tests
	scripts/test.sh
archive: ## build the archive into model-store/
	scripts/build_archive.sh
proto:   ## regenerate the gRPC stubs from proto/
	.venv/bin/python scripts/gen_proto.py
settings-table: ## rewrite README.md's table of environment variables from llm_api/model/settings.py
	.venv/bin/python scripts/settings_table.py --write
