# kvrouter — every target here is what CI or a person runs; `make help` lists them.
GO      ?= go
BIN     := bin
PKGS    := ./...
# Tests that need a cluster or the network get longer; unit tests stay fast.
TESTFLAGS ?= -race -count=1 -timeout 20m

.PHONY: help build build-core peers test test-peers reference bench figures figures-check run drain-live drain-sessions-live sessions-live certs check chaos chaos-short chaos-soak fuzz clean

help: ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-8s %s\n", $$1, $$2}'

build: build-core peers ## build kvrouter, kvmock, kvbench and the kvbench-gaie peer (its own module, peers/gaie) into bin/

# What the local cluster, certificates and chaos need: not the peer, whose
# ~950-package build takes minutes on a cold cache (make run's readiness
# clock would run through it).
build-core: ## build kvrouter, kvmock and kvbench into bin/ (no peer)
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/...

peers: ## build the kvbench-gaie peer (GAIE's scheduler, its own module peers/gaie) into bin/
	@mkdir -p $(BIN)
	cd peers/gaie && $(GO) build -o $(abspath $(BIN))/ ./cmd/kvbench-gaie

test: check reference ## what CI runs: static checks, then every test with the race detector
	$(GO) test $(TESTFLAGS) $(PKGS)

# The peer modules (peers/*) have their own go.mod, so ./... above skips them.
test-peers: ## go vet and every test of the peer module peers/gaie (GAIE's scheduler behind kvbench sim)
	cd peers/gaie && $(GO) vet ./... && $(GO) test $(TESTFLAGS) ./...

reference: ## install the pinned reference tokenizers and chat templates (npm) the exact-token tests compare against
	@if command -v npm >/dev/null; then ./.ci/install-reference; \
	else echo "npm not found: the exact-token reference tests will skip (apt-get install nodejs npm)"; fi

bench: ## router micro-benchmarks (figures go to BENCHMARKS.md)
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 2s ./router/

# BENCHMARKS.md's marked tables (<!-- figure: NAME -->) rerun from the command printed beside each;
# FIGURES=name,… for some of them (bin/kvbench figures --list names them and what each costs).
FIGURES ?=
figures: ## rerun BENCHMARKS.md's printed simulator commands and rewrite their tables in place
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/kvbench ./cmd/kvbench
	cd peers/gaie && $(GO) build -o $(abspath $(BIN))/ ./cmd/kvbench-gaie
	$(BIN)/kvbench figures --write $(if $(FIGURES),--only $(FIGURES))

figures-check: ## rerun them and fail with a diff where BENCHMARKS.md differs (CI: the calibration figures)
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/kvbench ./cmd/kvbench
	cd peers/gaie && $(GO) build -o $(abspath $(BIN))/ ./cmd/kvbench-gaie
	$(BIN)/kvbench figures --check $(if $(FIGURES),--only $(FIGURES))

run: build-core ## local cluster: 3 replicas (127.0.0.1:8001-8003), 4 kvmock workers, HAProxy on :8000 if installed; TLS and auth on (SECURITY.md)
	./deploy/local/run.sh

drain-live: build-core ## issue 29 live: make run's cluster (ports +300), drain one of four kvmocks under kvbench load, check it (deploy/local/drain-live.sh)
	./deploy/local/drain-live.sh

drain-sessions-live: build-core ## issue 29 live: a drained worker's sessions' next-turn cache, plain drain against --router-drain-shadow (ports +300; deploy/local/drain-sessions-live.sh)
	./deploy/local/drain-sessions-live.sh

sessions-live: build-core ## issue 28 live: make run's cluster (ports +400) with session affinity, 20 sessions x 8 turns over the three replicas by header and by prompt_cache_key, one worker each (deploy/local/sessions-live.sh)
	./deploy/local/sessions-live.sh

# Certificates for a deployment: make certs CERTS_DIR=certs NODES=r1=host[,ip],r2=... WORKERS=w1,w2
CERTS_DIR ?= certs
NODES     ?= r1=127.0.0.1,r2=127.0.0.1,r3=127.0.0.1
WORKERS   ?= mock-1,mock-2,mock-3,mock-4
certs: build-core ## private CA + node and worker certificates: make certs CERTS_DIR=certs NODES=r1=host,… WORKERS=w1,…
	$(BIN)/kvrouter certs --dir "$(CERTS_DIR)" --nodes "$(NODES)" --workers "$(WORKERS)"

# vet with the tests' build flags (-race): go test -race then reuses vet's compiles of every
# dependency instead of compiling them all a second time (on a cold cache that was half of make test).
check: ## gofmt, go vet, and the import-direction rules
	@out=$$(gofmt -l router fsm cluster eventbus api cmd engine chaos internal peers 2>/dev/null); \
		if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet -race $(PKGS)
	@./.ci/check-imports

chaos: build-core ## fault-injection suite: make chaos SCENARIOS=T1,T4 DURATION=60s
	./chaos/run.sh "$(SCENARIOS)" "$(DURATION)"

chaos-short: build-core ## CI tier of the chaos suite: every scenario, 45 s of faults each (~13.5 min with G1, D1, A1 and AF1, root)
	./chaos/run.sh short 45s

chaos-soak: build-core ## chaos soak: every scenario, SOAK=10m of faults each (override SOAK=30m)
	./chaos/run.sh all "$(or $(SOAK),10m)"

fuzz: ## run every fuzz target for FUZZTIME each (default 10s)
	./.ci/fuzz-all $${FUZZTIME:-10s}

clean: ## remove build output
	rm -rf $(BIN) chaos/out
