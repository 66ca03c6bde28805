.PHONY: serve test archive proto
serve:   ## set up and serve the embedded model with TorchServe
	scripts/serve.sh
test:    ## set up and run the tests
	scripts/test.sh
archive: ## build the archive into model-store/
	scripts/build_archive.sh
proto:   ## regenerate the gRPC stubs from proto/
	.venv/bin/python scripts/gen_proto.py
