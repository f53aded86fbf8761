package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cmd/kvrouter/internal/k8spool"
	"github.com/kvrouter/kvrouter/cmd/kvrouter/internal/replica"
	"github.com/kvrouter/kvrouter/internal/netaddr"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/router"
)

// serveConfig is everything `kvrouter serve` is told: the replica's
// configuration, which the flags fill directly, plus what only the command
// line uses.
type serveConfig struct {
	replica.Config
	LogLevel string
	Warnings []string // options that change nothing as given (Dynamo names without effect here, dynamo.go), logged at start
	// poolWorkers are --workers-file's entries, joined to --workers' in
	// finish (either flag may come first).
	poolWorkers []replica.StaticWorker
}

// flagSpec binds one flag, its environment variable(s), and Dynamo's
// spellings of both, to a setter.
type flagSpec struct {
	names []string // first is ours; the rest are accepted aliases (Dynamo's)
	env   []string
	def   string
	usage string
	set   func(string) error
	bool  bool // a switch: "--name" alone means true
}

// parseServe reads flags, then environment variables for flags not given.
func parseServe(args []string, getenv func(string) string, stderr io.Writer) (serveConfig, error) {
	c := serveConfig{Config: replica.Config{Router: router.DefaultConfig(), BusyStatus: 529, Retries: 2, MaxBodyBytes: 8 << 20}}
	dyn := dynamoState{given: map[string]string{}}
	var loopbackWorkers, plainHTTP *bool
	var secretFiles struct{ admin, worker, replica, workerKeys string }
	c.MaxPriority = math.MaxInt32 // no cap unless --max-priority: Dynamo lets clients set it
	warned := map[string]bool{}
	warn := func(msg string) { // one line per distinct warning, logged at start
		if !warned[msg] {
			warned[msg] = true
			c.Warnings = append(c.Warnings, msg)
		}
	}
	specs := []flagSpec{
		{names: []string{"node-id"}, env: []string{"KVROUTER_NODE_ID"}, def: "r1", usage: "this replica's id (unique in the cluster)", set: str(&c.NodeID)},
		{names: []string{"data-dir"}, env: []string{"KVROUTER_DATA_DIR"}, usage: "Raft and JetStream data (default data/<node-id>)", set: str(&c.DataDir)},
		{names: []string{"http-addr"}, env: []string{"KVROUTER_HTTP_ADDR"}, def: "127.0.0.1:8001", usage: "HTTP listen address", set: str(&c.HTTPAddr)},
		{names: []string{"advertise-http"}, env: []string{"KVROUTER_ADVERTISE_HTTP"}, usage: "base URL peers reach this replica at (default http://<http-addr>)", set: str(&c.AdvertiseHTTP)},
		{names: []string{"raft-addr"}, env: []string{"KVROUTER_RAFT_ADDR"}, def: "127.0.0.1:7001", usage: "Raft TCP address (bind and advertise)", set: str(&c.RaftAddr)},
		{names: []string{"advertise-raft"}, env: []string{"KVROUTER_ADVERTISE_RAFT"}, usage: "Raft address peers dial (default --raft-addr; set it when binding 0.0.0.0)", set: str(&c.AdvertiseRaft)},
		{names: []string{"nats-addr"}, env: []string{"KVROUTER_NATS_ADDR"}, def: "127.0.0.1:4222", usage: "embedded NATS client address", set: str(&c.NATSAddr)},
		{names: []string{"nats-cluster-addr"}, env: []string{"KVROUTER_NATS_CLUSTER_ADDR"}, def: "127.0.0.1:6222", usage: "embedded NATS cluster (routes) address", set: str(&c.NATSClusterAddr)},
		{names: []string{"nats-routes"}, env: []string{"KVROUTER_NATS_ROUTES"}, usage: "comma list of the other replicas' NATS cluster URLs (nats://host:port)", set: list(&c.NATSRoutes)},
		{names: []string{"nats-url"}, env: []string{"KVROUTER_NATS_URL"}, usage: "use this external NATS cluster instead of the embedded server", set: str(&c.NATSURL)},
		{names: []string{"peers"}, env: []string{"KVROUTER_PEERS"}, usage: "expected initial members id=raft-host:port,… (bootstrap once when nothing answers --join)", set: func(v string) error {
			ps, err := parsePeers(v)
			c.Peers = ps
			return err
		}},
		{names: []string{"join"}, env: []string{"KVROUTER_JOIN"}, usage: "comma list of replica HTTP URLs to join through", set: list(&c.Join)},
		{names: []string{"pooled-wait-weight"}, env: []string{"KVROUTER_POOLED_WAIT_WEIGHT"}, usage: "kv-pooled: price of one second of expected wait at a worker over the admission line, in its observed prefill blocks per second (default 0: no wait price, such workers are excluded); trades TTFT for cache at long outputs (BENCHMARKS.md, \"A queue price from the expected wait\")", set: func(v string) error {
			w, err := strconv.ParseFloat(v, 64)
			if err != nil || w < 0 || math.IsNaN(w) || math.IsInf(w, 0) {
				return fmt.Errorf("--pooled-wait-weight must be a number >= 0, got %q", v)
			}
			c.Router.Pooled.WaitWeight = &w
			return nil
		}},
		{names: []string{"raft-groups"}, env: []string{"KVROUTER_RAFT_GROUPS"}, def: "1", usage: "Raft groups the block index is sharded across (1: one group, as before; G > 1: a control group plus G data groups, workers placed by a replicated map; every replica must use the same G)", set: intp(&c.RaftGroups)},
		{names: []string{"raft-group-port-step"}, env: []string{"KVROUTER_RAFT_GROUP_PORT_STEP"}, def: "100", usage: "with --raft-groups G > 1, data group g listens on the Raft port + g × this (peers' addresses shift alike)", set: intp(&c.RaftGroupPortStep)},
		{names: []string{"single-node"}, env: []string{"KVROUTER_SINGLE_NODE"}, usage: "a one-replica cluster (development)", set: boolp(&c.SingleNode), bool: true},
		{names: []string{"model"}, env: []string{"KVROUTER_MODELS"}, def: "kvmock", usage: "comma list of served model names", set: list(&c.Models)},
		{names: []string{"model-dir"}, env: []string{"KVROUTER_MODEL_DIRS"}, usage: "NAME=DIR: the model's Hugging Face files (tokenizer.json, tokenizer_config.json, chat template); repeatable (environment: comma list)", set: func(v string) error {
			ds, err := parseModelDirs(v)
			c.ModelDirs = append(c.ModelDirs, ds...)
			return err
		}},
		{names: []string{"tokenizer"}, env: []string{"KVROUTER_TOKENIZER"}, def: "builtin", usage: "\"builtin\" or the path of a Hugging Face tokenizer.json for the --model names without --model-dir (must match the workers')", set: str(&c.Tokenizer)},
		{names: []string{"chat-template"}, env: []string{"KVROUTER_CHAT_TEMPLATE"}, usage: "chatml or plain (default: chatml for tokenizer.json, plain for builtin)", set: str(&c.ChatTemplate)},
		{names: []string{"router-mode"}, env: []string{"KVROUTER_ROUTER_MODE", "DYN_ROUTER_MODE"}, def: "kv", usage: "round-robin, random, least-loaded, kv, kv-approx, load-aware, kv-pooled", set: func(v string) error {
			m, err := parseDynamoMode(v, warn, &dyn)
			c.Router.Mode = m
			return err
		}},
		{names: []string{"kv-cache-block-size", "block-size"}, env: []string{"KVROUTER_BLOCK_SIZE", "DYN_KV_CACHE_BLOCK_SIZE"}, def: "16", usage: "tokens per KV block; must equal the engines'", set: intp(&c.Router.BlockSize)},
		{names: []string{"router-kv-overlap-score-credit"}, env: []string{"KVROUTER_OVERLAP_CREDIT", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT"}, def: "1", usage: "credit per cached block, 0..1", set: floatp(&c.Router.OverlapCredit)},
		{names: []string{"router-prefill-load-scale"}, env: []string{"KVROUTER_PREFILL_LOAD_SCALE", "DYN_ROUTER_PREFILL_LOAD_SCALE"}, def: "1", usage: "weight of prefill blocks against decode blocks (Dynamo's; its deprecated overlap_score_weight)", set: floatp(&c.Router.PrefillLoadScale)},
		{names: []string{"router-temperature"}, env: []string{"KVROUTER_TEMPERATURE", "DYN_ROUTER_TEMPERATURE"}, def: "0", usage: "0 = lowest cost; above 0 = softmax sampling", set: floatp(&c.Router.Temperature)},
		// --no-router-kv-events and --no-router-track-prefill-tokens are
		// Dynamo's pairs (dynamo.go); these are our environment names.
		{env: []string{"KVROUTER_NO_KV_EVENTS"}, set: func(v string) error {
			b, err := strconv.ParseBool(v)
			if b {
				dyn.noEvents = dyn.src
			}
			return err
		}},
		{names: []string{"router-ttl-secs"}, env: []string{"KVROUTER_TTL_SECS", "DYN_ROUTER_TTL_SECS"}, def: "120", usage: "lifetime of predicted blocks in approximate mode", set: secs(&c.Router.ApproxTTL)},
		{names: []string{"router-queue-threshold"}, env: []string{"KVROUTER_QUEUE_THRESHOLD", "DYN_ROUTER_QUEUE_THRESHOLD"}, usage: "queue requests while every worker's prefill tokens exceed this fraction of its max batched tokens", set: optFloat(&c.Router.QueueThreshold)},
		{names: []string{"router-queue-policy"}, env: []string{"KVROUTER_QUEUE_POLICY", "DYN_ROUTER_QUEUE_POLICY"}, def: "fcfs", usage: "fcfs, wspt or lcfs", set: func(v string) error { c.Router.QueuePolicy = router.QueuePolicy(v); return nil }},
		{env: []string{"KVROUTER_NO_TRACK_PREFILL_TOKENS"}, set: func(v string) error {
			b, err := strconv.ParseBool(v)
			if b {
				c.Router.TrackPrefillTokens = false
			}
			return err
		}},
		{names: []string{"active-decode-blocks-threshold"}, env: []string{"KVROUTER_ACTIVE_DECODE_BLOCKS_THRESHOLD", "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD"}, usage: "busy above this fraction of KV blocks in use, 0..1", set: optFloat(&c.Router.Thresholds.ActiveDecodeBlocks)},
		{names: []string{"active-prefill-tokens-threshold"}, env: []string{"KVROUTER_ACTIVE_PREFILL_TOKENS_THRESHOLD", "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD"}, usage: "busy above this many prefill tokens", set: optInt(&c.Router.Thresholds.ActivePrefillTokens)},
		{names: []string{"active-prefill-tokens-threshold-frac"}, env: []string{"KVROUTER_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC", "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC"}, usage: "busy above this fraction of max batched tokens", set: optFloat(&c.Router.Thresholds.ActivePrefillTokensFrac)},
		{names: []string{"busy-status"}, env: []string{"KVROUTER_BUSY_STATUS"}, def: "529", usage: "HTTP status when every worker is busy (529 or 503)", set: intp(&c.BusyStatus)},
		{names: []string{"admin-token"}, env: []string{"KVROUTER_ADMIN_TOKEN"}, usage: "bearer token required by admin endpoints (prefer --admin-token-file: argv is visible to every local user)", set: str(&c.AdminToken)},
		{names: []string{"admin-token-file"}, env: []string{"KVROUTER_ADMIN_TOKEN_FILE"}, usage: "file holding the admin token (instead of --admin-token)", set: str(&secretFiles.admin)},
		{names: []string{"worker-api-key"}, env: []string{"KVROUTER_WORKER_API_KEY"}, usage: "bearer token sent to every worker (engines started with --api-key; prefer --worker-api-key-file)", set: secret(&c.WorkerAPIKey)},
		{names: []string{"worker-api-key-file"}, env: []string{"KVROUTER_WORKER_API_KEY_FILE"}, usage: "file holding the worker API key", set: str(&secretFiles.worker)},
		{names: []string{"worker-api-keys-file"}, env: []string{"KVROUTER_WORKER_API_KEYS_FILE"}, usage: "per-worker API keys: a file of \"<worker id> <key file>\" lines (key files relative to it); a named worker gets its own key instead of --worker-api-key (workerkeys.go)", set: str(&secretFiles.workerKeys)},
		{names: []string{"replica-token-file"}, env: []string{"KVROUTER_REPLICA_TOKEN_FILE"}, usage: "file holding a token that admits bus clients without a certificate with a replica's rights (tools such as kvbench ingest); needs TLS material", set: str(&secretFiles.replica)},
		{names: []string{"api-keys"}, env: []string{"KVROUTER_API_KEYS"}, usage: "comma list of accepted inference API keys", set: list(&c.APIKeys)},
		{names: []string{"api-client-certs"}, env: []string{"KVROUTER_API_CLIENT_CERTS"}, usage: "require a client certificate of the cluster's CA naming an API client (kvrouter certs --clients) on /v1/*, /tokenize and /detokenize (needs TLS material; with --api-keys both are required)", set: boolp(&c.APIClientCerts), bool: true},
		{names: []string{"workers"}, env: []string{"KVROUTER_WORKERS"}, usage: "static workers id=http://host:port,… (registered for the first model); give each its capacity as id=URL;total_kv_blocks=N;max_num_batched_tokens=M (quote the ';' from the shell), else the capacity-relative thresholds do not apply to it and /cluster/status says so", set: func(v string) error {
			ws, err := parseStatic(v)
			c.StaticWorkers = ws
			return err
		}},
		{names: []string{"workers-file"}, env: []string{"KVROUTER_WORKERS_FILE"}, usage: "a static pool: a file of workers, one --workers entry per line (id=URL[;total_kv_blocks=N][;max_num_batched_tokens=M]; blank lines and # comments skipped), registered with --workers' for a gateway without Kubernetes", set: func(v string) error {
			ws, err := readWorkersFile(v)
			c.poolWorkers = ws
			return err
		}},
		{names: []string{"inference-pool"}, env: []string{"KVROUTER_INFERENCE_POOL"}, usage: "namespace/name of a Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1) whose selector's Ready pods, at its target ports, are workers of the first model: the Raft leader registers and deregisters them as the pool and its pods change (cmd/kvrouter/internal/k8spool)", set: func(v string) error {
			ref, err := k8spool.ParseRef(v)
			c.InferencePool = ref
			return err
		}},
		{names: []string{"kubeconfig"}, env: []string{"KVROUTER_KUBECONFIG"}, usage: "kubeconfig file for --inference-pool (empty: the pod's in-cluster service account)", set: str(&c.Kubeconfig)},
		{names: []string{"retries"}, env: []string{"KVROUTER_RETRIES"}, def: "2", usage: "other workers tried when a worker could not have started the request (connection refused, dial or TLS failure, 503/529 before any byte); never after the request reached it", set: intp(&c.Retries)},
		{names: []string{"events-missing-after"}, env: []string{"KVROUTER_EVENTS_MISSING_AFTER"}, def: "60s", usage: "warn when a routed worker has published no KV events this long", set: dur(&c.EventsMissing)},
		{names: []string{"tokenizer-check-interval"}, env: []string{"KVROUTER_TOKENIZER_CHECK_INTERVAL"}, def: "10m", usage: "self-check: send canary requests to each worker's /tokenize when it registers and about this often after (jittered), and warn when its ids differ from ours (0: never)", set: dur(&c.TokenizerCheck)},
		{names: []string{"bridge-config"}, env: []string{"KVROUTER_BRIDGE_CONFIG"}, usage: "JSON file of vLLM/SGLang engines whose ZMQ KV events this replica bridges in-process (see eventbus/zmqbridge/README.md)", set: str(&c.BridgeConfig)},
		{names: []string{"drain-delay"}, env: []string{"KVROUTER_DRAIN_DELAY"}, def: "2s", usage: "on SIGTERM, report not ready this long (the load balancer moves away) before stopping; then in-flight requests finish", set: dur(&c.DrainDelay)},
		{names: []string{"drain-timeout"}, env: []string{"KVROUTER_DRAIN_TIMEOUT"}, def: "30s", usage: "after --drain-delay, wait this long at most for in-flight requests before closing the listener", set: dur(&c.DrainTimeout)},
		{names: []string{"tls-ca"}, env: []string{"KVROUTER_TLS_CA"}, usage: "PEM CA certificate of the cluster (kvrouter certs makes one)", set: str(&c.TLS.CAFile)},
		{names: []string{"tls-cert"}, env: []string{"KVROUTER_TLS_CERT"}, usage: "PEM certificate of this node (identity spiffe://kvrouter/node/<node-id>)", set: str(&c.TLS.CertFile)},
		{names: []string{"tls-key"}, env: []string{"KVROUTER_TLS_KEY"}, usage: "PEM private key of this node", set: str(&c.TLS.KeyFile)},
		{names: []string{"worker-tls-ca"}, env: []string{"KVROUTER_WORKER_TLS_CA"}, usage: "PEM CA certificate(s) that the certificates of https:// workers must chain to (instead of the system roots)", set: str(&c.WorkerTLSCA)},
		{names: []string{"insecure"}, env: []string{"KVROUTER_INSECURE"}, usage: "run without TLS and authentication (Raft, bus, cluster endpoints) on purpose (logged every minute)", set: boolp(&c.Insecure), bool: true},
		{names: []string{"allow-plain-http"}, env: []string{"KVROUTER_ALLOW_PLAIN_HTTP"}, usage: "with TLS material, also serve plaintext HTTP on the HTTP port (default: true only when --http-addr is loopback); /cluster/* still needs a member certificate", set: func(v string) error {
			b, err := strconv.ParseBool(v)
			plainHTTP = &b
			return err
		}, bool: true},
		{names: []string{"allow-loopback-workers"}, env: []string{"KVROUTER_ALLOW_LOOPBACK_WORKERS"}, usage: "accept workers on loopback, link-local or unspecified addresses (default: true only when --http-addr is a loopback address; otherwise the proxy could be pointed at this host's own ports)", set: func(v string) error {
			b, err := strconv.ParseBool(v)
			loopbackWorkers = &b
			return err
		}, bool: true},
		// The name of Dynamo's agentic cache control work (a development
		// branch of its router, not a released flag: no Dynamo row).
		{names: []string{"enable-agentic-cache-control"}, env: []string{"KVROUTER_ENABLE_AGENTIC_CACHE_CONTROL"}, bool: true, set: boolp(&c.Pins),
			usage: "pin a request's prompt prefix on its worker for nvext.cache_control's TTL ({\"type\": \"ephemeral\", \"ttl\": \"5m\"}), on every replica: requests starting with it go to its holders, and kv-pooled never prices its eviction as free (default false)"},
		{names: []string{"max-priority"}, env: []string{"KVROUTER_MAX_PRIORITY"}, usage: "highest nvext.agent_hints.priority a client may set (default: no cap, as Dynamo); higher values are lowered to it", set: intp(&c.MaxPriority)},
		{names: []string{"max-priority-by-key"}, env: []string{"KVROUTER_MAX_PRIORITY_BY_KEY"}, usage: "per API key caps KEY=N,… (override --max-priority)", set: func(v string) error {
			m, err := parseKeyInts(v)
			c.MaxPriorityByKey = m
			return err
		}},
		{names: []string{"max-workers"}, env: []string{"KVROUTER_MAX_WORKERS"}, usage: "registered workers at most (default 1024; 429 beyond)", set: intp(&c.MaxWorkers)},
		{names: []string{"max-queue"}, env: []string{"KVROUTER_MAX_QUEUE"}, usage: "requests waiting in one model's admission queue at most (default 1024; beyond, --busy-status (529) with Retry-After, as Dynamo answers a full queue)", set: intp(&c.MaxQueue)},
		{names: []string{"tenant-from"}, env: []string{"KVROUTER_TENANT_FROM"}, def: "none", usage: "where a request's tenant comes from for fair shares and budgets: none (fairness off), api-key (the client's bearer key, hashed: key-<12 hex>) or header (--tenant-header)", set: func(v string) error {
			c.Tenants.From = api.TenantSource(v)
			return nil
		}},
		{names: []string{"tenant-header"}, env: []string{"KVROUTER_TENANT_HEADER"}, def: api.DefaultTenantHeader, usage: "the header naming the tenant with --tenant-from header (GAIE's fairness id by default); values over 64 bytes or not printable are hashed", set: str(&c.Tenants.Header)},
		{names: []string{"tenant-max"}, env: []string{"KVROUTER_TENANT_MAX"}, def: "1024", usage: "tenants tracked per model; every tenant beyond shares one share (_overflow)", set: intp(&c.Tenants.MaxTenants)},
		{names: []string{"tenant-metrics-max"}, env: []string{"KVROUTER_TENANT_METRICS_MAX"}, def: "32", usage: "tenants with their own kvrouter_tenant_* series (the first seen); the rest are summed as _other", set: intp(&c.Tenants.MetricTenants)},
		{names: []string{"tenant-tokens-per-minute"}, env: []string{"KVROUTER_TENANT_TOKENS_PER_MINUTE"}, def: "0", usage: "a tenant's budget of charged tokens (uncached prompt + output) per minute, fleet-wide as replica sync reports it; beyond, 429 with Retry-After (0: none)", set: func(v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			c.Tenants.TokensPerMinute = n
			return err
		}},
		{names: []string{"tenant-max-concurrent"}, env: []string{"KVROUTER_TENANT_MAX_CONCURRENT"}, def: "0", usage: "a tenant's requests admitted or queued and not finished, fleet-wide; beyond, 429 with Retry-After (0: none)", set: intp(&c.Tenants.MaxConcurrent)},
		{names: []string{"tenant-fair-slack"}, env: []string{"KVROUTER_TENANT_FAIR_SLACK"}, def: "512", usage: "tokens a tenant waiting on another replica must be below this replica's next tenant before this replica holds its request back for it (keep it well below --tenant-fair-burst)", set: floatp(&c.Tenants.Slack)},
		{names: []string{"tenant-fair-burst"}, env: []string{"KVROUTER_TENANT_FAIR_BURST"}, def: "4096", usage: "tokens a tenant may be below the least served active tenant when it starts or queues a request: the credit a tenant under its share spends at once, and all the credit idling banks (1: start-time fair queueing exactly)", set: floatp(&c.Tenants.Burst)},
		{names: []string{"tenant-headroom"}, env: []string{"KVROUTER_TENANT_HEADROOM"}, usage: "hold a tenant over its share, while other tenants are active, to its share (1 / active tenants) of each worker's queue-threshold window, counting what its request makes each worker compute (its prompt less that worker's cached prefix), so the rest stays free for them (lower tail TTFT for tenants under their share, less throughput while they are active; needs --router-queue-threshold)", set: boolp(&c.Tenants.Headroom), bool: true},
		{names: []string{"tenant-engine-priority"}, env: []string{"KVROUTER_TENANT_ENGINE_PRIORITY"}, usage: "set the JSON field priority of every request sent to a worker from the tenant ledger: 0 while its tenant is not over its share, 2^32 while it is and another tenant is active, less the request's nvext.agent_hints.priority (lower is served first); the workers must schedule by it (vLLM --scheduling-policy priority, SGLang --enable-priority-scheduling --schedule-low-priority-values-first; vLLM refuses a non-zero priority otherwise); needs --tenant-from", set: boolp(&c.Tenants.EnginePriority), bool: true},
		{names: []string{"tenant-latency-guard"}, env: []string{"KVROUTER_TENANT_LATENCY_GUARD"}, def: "0", usage: "a factor F >= 1 (0: off): a request of a tenant over its share, while another tenant is active, goes only to a worker where a fresh request is predicted to get its TTFT and TPOT within F x their values on an idle worker (kv-pooled's SLO prediction: the worker's prefill queue and KV wait, the TPOT line against its fill; the router learns its rates in every mode with this set), and otherwise waits in the admission queue; tenants at or under their share are never held. Keeps capacity idle on purpose: less throughput for the over-share tenant while others are active, a lower tail TTFT for the others (needs --tenant-from and --router-queue-threshold)", set: floatp(&c.Tenants.LatencyGuard)},
		{names: []string{"tenant-isolation"}, env: []string{"KVROUTER_TENANT_ISOLATION"}, def: "0", usage: "a safety factor S >= 1 (0: off): while a tenant is over its share and another is active, k = ceil(workers x S x the under-share tenants' share of the tokens charged fleet-wide over the last 5 s) of a model's workers (at least 1, at most all but one; the first k in rendezvous order of their ids, so every replica reserves the same ones) are kept for the tenants under their share: the over-share tenant's requests go only to the other workers and wait in the admission queue while those are full; an under-share tenant's go to a reserved worker while one has room, else anywhere (with --tenant-latency-guard: to the worker quickest to their first token, reserved ones first among ties, the guard judging the unreserved workers by TTFT alone), and pass the over-share tenant's queued backlog when they have room and nothing of their own queued. Keeps whole workers free of the flood: less throughput for it while others are active (needs --tenant-from and --router-queue-threshold)", set: floatp(&c.Tenants.Isolation)},
		{names: []string{"tenant-sync-interval"}, env: []string{"KVROUTER_TENANT_SYNC_INTERVAL"}, def: "100ms", usage: "how often tenant usage goes out on replica sync when it changed (the fairness sync lag)", set: dur(&c.TenantSyncInterval)},
		{names: []string{"max-entry-bytes"}, env: []string{"KVROUTER_MAX_ENTRY_BYTES"}, def: strconv.Itoa(replica.DefaultMaxEntryBytes), usage: fmt.Sprintf("bytes one Raft entry of KV events may encode to, %d to %d (4 MiB by default): a larger ingest batch is committed as several entries, in order, each acked once committed; a single event larger than this is refused (kvrouter_eventbus_events_rejected_total{reason=\"too_large\"})", replica.MinMaxEntryBytes, replica.MaxMaxEntryBytes), set: intp(&c.MaxEntryBytes)},
		{names: []string{"worker-header-timeout"}, env: []string{"KVROUTER_WORKER_HEADER_TIMEOUT"}, usage: "longest wait for a worker's answer headers (default 10m)", set: dur(&c.WorkerHeaderTimeout)},
		{names: []string{"worker-idle-timeout"}, env: []string{"KVROUTER_WORKER_IDLE_TIMEOUT"}, usage: "longest silence inside a worker's answer body before it is cut and its booking freed (default 2m)", set: dur(&c.WorkerIdleTimeout)},
		{names: []string{"ext-proc-listen"}, env: []string{"KVROUTER_EXT_PROC_LISTEN"}, usage: "also serve the Gateway API endpoint picker (Envoy ext_proc gRPC, GAIE's protocol) on this address; TLS with the cluster's material as every port (empty: off)", set: str(&c.ExtProcAddr)},
		{names: []string{"ext-proc-fallbacks"}, env: []string{"KVROUTER_EXT_PROC_FALLBACKS"}, def: "0", usage: "endpoints the picker lists after its choice, cheapest first, for a gateway that tries them in order when it cannot connect (0: the choice alone, as GAIE's reference picker; a plain ORIGINAL_DST cluster reads one ip:port)", set: func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 || n > 16 {
				return fmt.Errorf("--ext-proc-fallbacks %q: an integer in [0, 16]", v)
			}
			c.ExtProcFallbacks = n
			return nil
		}},
		{names: []string{"reservation-ttl"}, env: []string{"KVROUTER_RESERVATION_TTL"}, usage: "frees a selection API reservation (/select_and_reserve, /reservations) never released after this long (default 10m)", set: dur(&c.ReservationTTL)},
		{names: []string{"protect-status"}, env: []string{"KVROUTER_PROTECT_STATUS"}, usage: "require the admin token for /cluster/status and /metrics", set: boolp(&c.ProtectStatus), bool: true},
		{names: []string{"decision-log-size"}, env: []string{"KVROUTER_DECISION_LOG_SIZE"}, def: "4096", usage: "routing decisions kept in memory for GET /debug/decisions (cost table, index epoch, outcome); 0 turns the log off", set: intp(&c.DecisionLogSize)},
		{names: []string{"decision-log-file"}, env: []string{"KVROUTER_DECISION_LOG_FILE"}, usage: "also append every completed decision to this JSON-lines file, rotated by size (3 old files kept)", set: str(&c.DecisionLogFile)},
		{names: []string{"decision-log-max-bytes"}, env: []string{"KVROUTER_DECISION_LOG_MAX_BYTES"}, def: "67108864", usage: "size at which --decision-log-file rotates", set: func(v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 4096 {
				return fmt.Errorf("--decision-log-max-bytes must be an integer of at least 4096, got %q", v)
			}
			c.DecisionLogMaxBytes = n
			return nil
		}},
		{names: []string{"digest-checkpoint-every"}, env: []string{"KVROUTER_DIGEST_CHECKPOINT_EVERY"}, def: "4096", usage: "digest the replicated state after every Raft entry whose index is a multiple of this, so replicas compare states while events keep coming (state_agreement in /cluster/status, kvrouter_replica_state_mismatch); the same on every replica; each costs a copy of the block index under the apply lock (~95 ms per million blocks); 0 turns it off", set: func(v string) error {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil || (n > 0 && n < 64) {
				return fmt.Errorf("--digest-checkpoint-every must be 0 or an integer of at least 64, got %q", v)
			}
			c.DigestCheckpointEvery = n
			return nil
		}},
		{names: []string{"hit-rate-max-blocks"}, env: []string{"KVROUTER_HIT_RATE_MAX_BLOCKS"}, def: "0", usage: "block history per model behind the \"available\" hit rate (0: 1 Mi blocks, about 64 MiB per model when full; raised to the fleet's capacity when that is larger); -1 turns the hit rates off", set: func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < -1 {
				return fmt.Errorf("--hit-rate-max-blocks must be -1, 0 or a positive integer, got %q", v)
			}
			c.HitRateMaxBlocks = n
			return nil
		}},
		{names: []string{"router-warmup-share"}, env: []string{"KVROUTER_ROUTER_WARMUP_SHARE"}, def: "0", usage: "warm up joining workers: send a worker that joins a model's candidate set this share (0 to 1) of the requests whose prefix is new or held by two workers or more, on purpose, while the fleet is under 0.8 of its busy thresholds, until its hit rate reaches its model's (at most 10 min); 0 turns it off", set: func(v string) error {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || !(f >= 0 && f <= 1) {
				return fmt.Errorf("--router-warmup-share must be a number in [0, 1], got %q", v)
			}
			c.WarmUpShare = f
			return nil
		}},
		{names: []string{"router-warmup-shadow"}, env: []string{"KVROUTER_ROUTER_WARMUP_SHADOW"}, usage: "warm up joining workers by shadow prefills instead of steering requests (wins over --router-warmup-share): a prefill-only copy (max_tokens 1, not streamed, answer thrown away, never seen by the client) of each request whose prefix another worker holds and the joining worker lacks, once per prefix, while the fleet is under 0.8 of its busy thresholds; a request routed to the joining worker without its prefix goes to the holder instead, and one whose prefix a copy brought there goes there (off by default)", set: boolp(&c.WarmUpShadow), bool: true},
		{names: []string{"router-shadow-inflight"}, env: []string{"KVROUTER_ROUTER_SHADOW_INFLIGHT"}, def: "8", usage: "the most shadow prefills this replica runs at once: warm-up copies (--router-warmup-shadow; a copy that finds none free is not sent) and, separately, drain copies (--router-drain-shadow; they wait their turn)", set: func(v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 1024 {
				return fmt.Errorf("--router-shadow-inflight must be an integer in [1, 1024], got %q", v)
			}
			c.ShadowInflight = n
			return nil
		}},
		{names: []string{"router-drain-shadow"}, env: []string{"KVROUTER_ROUTER_DRAIN_SHADOW"}, usage: "with session affinity, move a drained worker's bound sessions by shadow prefills: each replica keeps the last body of each bound session it served (at most --router-session-bodies-max-bytes) and, when a drain commits, sends a prefill-only copy of it (max_tokens 1, answer thrown away) to the worker the session would be rebound to, then rebinds the session there, so its next turn finds its context cached (off by default)", set: boolp(&c.DrainShadow), bool: true},
		{names: []string{"router-session-bodies-max-bytes"}, env: []string{"KVROUTER_ROUTER_SESSION_BODIES_MAX_BYTES"}, def: "67108864", usage: "memory for the session bodies --router-drain-shadow keeps (bodies, their block hashes and 256 bytes each), least recently used dropped first", set: func(v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 1<<20 || n > 1<<40 {
				return fmt.Errorf("--router-session-bodies-max-bytes must be an integer in [1048576, 1099511627776], got %q", v)
			}
			c.SessionBodiesMaxBytes = n
			return nil
		}},
		{names: []string{"capture-file"}, env: []string{"KVROUTER_CAPTURE_FILE"}, usage: "capture answered requests as a Mooncake-format trace in this JSON-lines file (block hashes and lengths, no text; kvbench sim --trace replays it, kvbench tune sweeps settings on it), rotated by size (3 old files kept)", set: str(&c.CaptureFile)},
		{names: []string{"bus-consumer-file-state"}, env: []string{"KVROUTER_BUS_CONSUMER_FILE_STATE"}, usage: "keep the durable KV event consumer's state (deliveries, acks) in files as builds before issue 31 did, instead of in memory: for a rolling upgrade from such a build (their leaders cannot use the consumer with its state in memory and stall ingest while they lead); the durable is re-created when the setting changes, its unacked events delivered again", set: boolp(&c.BusConsumerFileState), bool: true},
		{names: []string{"pprof-addr"}, env: []string{"KVROUTER_PPROF_ADDR"}, usage: "serve Go's profiler (/debug/pprof/) on this loopback address, unauthenticated, for measuring a replica live (off when empty; an address off loopback is refused)", set: func(v string) error {
			if v != "" && !netaddr.LoopbackListen(v) {
				return fmt.Errorf("--pprof-addr must be a loopback address (host:port), got %q", v)
			}
			c.PprofAddr = v
			return nil
		}},
		{names: []string{"capture-sample"}, env: []string{"KVROUTER_CAPTURE_SAMPLE"}, def: "1", usage: "fraction of prompt prefixes captured, in (0, 1]: a request is kept when its first block is in the sample, so requests sharing a prefix are kept or dropped together", set: func(v string) error {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || !(f > 0 && f <= 1) {
				return fmt.Errorf("--capture-sample must be a number in (0, 1], got %q", v)
			}
			c.CaptureSample = f
			return nil
		}},
		{names: []string{"capture-max-bytes"}, env: []string{"KVROUTER_CAPTURE_MAX_BYTES"}, def: "67108864", usage: "size at which --capture-file rotates", set: func(v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 4096 {
				return fmt.Errorf("--capture-max-bytes must be an integer of at least 4096, got %q", v)
			}
			c.CaptureMaxBytes = n
			return nil
		}},
		{names: []string{"metrics-compat"}, env: []string{"KVROUTER_METRICS_COMPAT"}, def: "none", usage: "none, or dynamo: also export Dynamo's dynamo_frontend_* / dynamo_component_router_* metric names beside kvrouter_* (api/DESIGN.md)", set: func(v string) error {
			if v != "none" && v != "dynamo" { // api.MetricsCompatNone, api.MetricsCompatDynamo
				return fmt.Errorf("--metrics-compat must be none or dynamo, got %q", v)
			}
			c.MetricsCompat = v
			return nil
		}},
		{names: []string{"log-level"}, env: []string{"KVROUTER_LOG_LEVEL"}, def: "info", usage: "debug, info, warn, error", set: str(&c.LogLevel)},
	}
	specs = append(specs, disaggFlags(&c.Disagg)...)
	specs = append(specs, dynamoSpecs(&c, &dyn, warn)...)
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	for _, sp := range specs {
		if sp.def != "" {
			if err := sp.set(sp.def); err != nil {
				return c, fmt.Errorf("default of --%s: %w", sp.names[0], err)
			}
		}
		key := specKey(sp)
		for i, n := range sp.names {
			u := sp.usage
			if i > 0 {
				u = "alias of --" + sp.names[0]
			}
			if sp.bool {
				fs.Var(boolFlag{func(v string) error {
					dyn.src = "--" + n
					if v != "true" {
						dyn.src += "=" + v
					}
					dyn.given[key] = dyn.src
					return sp.set(v)
				}}, n, u)
			} else {
				fs.Func(n, u+envNote(sp.env), func(v string) error {
					dyn.src = "--" + n + "=" + v
					dyn.given[key] = dyn.src
					return sp.set(v)
				})
			}
		}
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, errHelp
		}
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, sp := range specs {
		if anyGiven(given, sp.names) {
			continue
		}
		for _, e := range sp.env {
			if v := getenv(e); v != "" {
				dyn.src = e + "=" + v
				dyn.given[specKey(sp)] = dyn.src
				if err := sp.set(v); err != nil {
					return c, fmt.Errorf("environment %s=%q: %w", e, v, err)
				}
				break
			}
		}
	}
	if len(c.ModelDirs) > 0 && !given["model"] && getenv("KVROUTER_MODELS") == "" {
		c.Models = nil // the model directories name the served models; the "kvmock" default does not apply
	}
	dyn.apply(&c, warn)
	if loopbackWorkers != nil {
		c.AllowLoopbackWorkers = *loopbackWorkers
	} else {
		c.AllowLoopbackWorkers = netaddr.LoopbackListen(c.HTTPAddr)
	}
	if plainHTTP != nil {
		c.AllowPlainHTTP = *plainHTTP
	} else {
		c.AllowPlainHTTP = netaddr.LoopbackListen(c.HTTPAddr)
	}
	if secretFiles.workerKeys != "" {
		keys, err := readWorkerKeys(secretFiles.workerKeys)
		if err != nil {
			return serveConfig{}, err
		}
		c.WorkerAPIKeys = keys
	}
	if err := c.readSecretFiles(secretFiles.admin, secretFiles.worker, secretFiles.replica); err != nil {
		return c, err
	}
	return c, c.finish()
}

// finish fills derived defaults and checks the whole.
func (c *serveConfig) finish() error {
	if err := c.Router.Validate(); err != nil {
		return err
	}
	static := map[string]bool{}
	for _, w := range c.StaticWorkers {
		static[w.ID] = true
	}
	for _, w := range c.poolWorkers {
		if static[w.ID] {
			return fmt.Errorf("--workers-file: worker %q is also in --workers (or twice in the file)", w.ID)
		}
		static[w.ID] = true
		c.StaticWorkers = append(c.StaticWorkers, w)
	}
	c.poolWorkers = nil
	if c.DataDir == "" {
		c.DataDir = filepath.Join("data", c.NodeID)
	}
	if err := c.checkSecurity(); err != nil {
		return err
	}
	if c.AdvertiseHTTP == "" {
		// With TLS material peers reach each other's /cluster/ endpoints
		// over HTTPS (the certificate is their credential).
		c.AdvertiseHTTP = c.httpScheme() + "://" + c.HTTPAddr
	} else if c.httpScheme() == "https" && !strings.HasPrefix(c.AdvertiseHTTP, "https://") {
		return fmt.Errorf("--advertise-http %q: with TLS material peers reach this replica over https://", c.AdvertiseHTTP)
	}
	if c.RaftGroups < 1 || c.RaftGroups > replica.MaxRaftGroups {
		return fmt.Errorf("--raft-groups must be 1 to %d, got %d", replica.MaxRaftGroups, c.RaftGroups)
	}
	if c.RaftGroups > 1 && (c.RaftGroupPortStep < 1 || c.RaftGroupPortStep*c.RaftGroups > 10000) {
		return fmt.Errorf("--raft-group-port-step must be at least 1 and keep every group's port within 10000 of --raft-addr's, got %d for %d groups", c.RaftGroupPortStep, c.RaftGroups)
	}
	if c.MaxEntryBytes < replica.MinMaxEntryBytes || c.MaxEntryBytes > replica.MaxMaxEntryBytes {
		return fmt.Errorf("--max-entry-bytes must be %d to %d, got %d", replica.MinMaxEntryBytes, replica.MaxMaxEntryBytes, c.MaxEntryBytes)
	}
	if _, err := api.NewTenantLedger(c.Tenants); err != nil {
		return fmt.Errorf("--tenant-from / --tenant-*: %w", err)
	}
	if c.Tenants.EnginePriority && (c.Tenants.From == "" || c.Tenants.From == api.TenantNone) {
		return errors.New("--tenant-engine-priority sets the priority from the tenant ledger: give --tenant-from")
	}
	if g := c.Tenants.LatencyGuard; g != 0 {
		if err := router.ValidateLatencyGuard(g); err != nil {
			return fmt.Errorf("--tenant-latency-guard: %w", err)
		}
		if c.Tenants.From == "" || c.Tenants.From == api.TenantNone {
			return errors.New("--tenant-latency-guard holds tenants over their share: give --tenant-from")
		}
		if c.Router.QueueThreshold == nil {
			return errors.New("--tenant-latency-guard holds requests in the admission queue: give --router-queue-threshold")
		}
		c.Router.LearnLatency = true // the guard predicts from the rates the router learns
	}
	if c.Tenants.Isolation != 0 {
		if c.Tenants.From == "" || c.Tenants.From == api.TenantNone {
			return errors.New("--tenant-isolation keeps tenants over their share off reserved workers: give --tenant-from")
		}
		if c.Router.QueueThreshold == nil {
			return errors.New("--tenant-isolation holds requests in the admission queue: give --router-queue-threshold")
		}
	}
	if c.TenantSyncInterval < 0 {
		return fmt.Errorf("--tenant-sync-interval must not be negative, got %s", c.TenantSyncInterval)
	}
	if c.BusyStatus != 529 && c.BusyStatus != 503 {
		return fmt.Errorf("--busy-status must be 529 or 503, got %d", c.BusyStatus)
	}
	if len(c.Models) == 0 {
		return errors.New("--model: at least one model name")
	}
	seen := map[string]bool{}
	for _, d := range c.ModelDirs {
		if seen[d.Name] {
			return fmt.Errorf("--model-dir: model %q given twice", d.Name)
		}
		seen[d.Name] = true
		if !slices.Contains(c.Models, d.Name) {
			c.Models = append(c.Models, d.Name)
		}
	}
	if c.SingleNode && (len(c.Peers) > 1 || len(c.Join) > 0) {
		return errors.New("--single-node excludes --peers with others and --join")
	}
	if !c.SingleNode && len(c.Peers) == 0 && len(c.Join) == 0 {
		return errors.New("say how to form the cluster: --peers (bootstrap), --join, or --single-node")
	}
	if c.Retries < 0 {
		return errors.New("--retries must not be negative")
	}
	if c.Disagg.Mode != router.DisaggOff {
		if _, err := c.Disagg.RouterConfig(); err != nil {
			return err
		}
	}
	return nil
}

// parseModelDirs reads NAME=DIR[,NAME=DIR…].
func parseModelDirs(v string) ([]replica.ModelDir, error) {
	var out []replica.ModelDir
	for _, item := range strings.Split(v, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, dir, ok := strings.Cut(item, "=")
		if !ok || strings.TrimSpace(name) == "" || strings.TrimSpace(dir) == "" {
			return nil, fmt.Errorf("--model-dir %q: want NAME=DIR", item)
		}
		out = append(out, replica.ModelDir{Name: strings.TrimSpace(name), Dir: strings.TrimSpace(dir)})
	}
	return out, nil
}

// checkSecurity applies the secure default (SECURITY.md): TLS material
// (all three files) puts Raft, the bus and the cluster endpoints behind
// mutual TLS. Listening off loopback needs that material and an admin
// token; without them a replica refuses to start, naming what is missing,
// unless --insecure says so on purpose. A replica listening on loopback
// only without material is a local development cluster: it runs insecure
// with a warning (repeated every minute).
func (c *serveConfig) checkSecurity() error {
	if c.APIClientCerts && (c.Insecure || c.TLS.IsZero()) {
		return errors.New("--api-client-certs checks TLS client certificates: it needs TLS material (--tls-ca, --tls-cert, --tls-key), not --insecure")
	}
	if c.Insecure {
		if !c.ReplicaToken.IsZero() {
			return errors.New("--replica-token-file admits bus clients over TLS: it needs TLS material, not --insecure")
		}
		return nil
	}
	var open []string
	for _, a := range []struct{ flag, addr string }{{"--http-addr", c.HTTPAddr}, {"--raft-addr", c.RaftAddr},
		{"--nats-addr", c.NATSAddr}, {"--nats-cluster-addr", c.NATSClusterAddr}} {
		if !netaddr.LoopbackListen(a.addr) {
			open = append(open, a.flag+" "+a.addr)
		}
	}
	if c.ExtProcAddr != "" && !netaddr.LoopbackListen(c.ExtProcAddr) {
		open = append(open, "--ext-proc-listen "+c.ExtProcAddr)
	}
	var missing []string
	if c.TLS.IsZero() {
		missing = append(missing, "TLS material (--tls-ca, --tls-cert, --tls-key; kvrouter certs makes them)")
	} else if m := c.TLS.Missing(); len(m) > 0 {
		return fmt.Errorf("TLS needs %s (--tls-ca, --tls-cert, --tls-key)", strings.Join(m, ", "))
	}
	if len(open) > 0 && c.AdminToken == "" {
		missing = append(missing, "an admin token (--admin-token-file or KVROUTER_ADMIN_TOKEN_FILE)")
	}
	if len(open) > 0 && len(missing) > 0 {
		return fmt.Errorf("listening off loopback (%s) needs %s — or --insecure to run unauthenticated on purpose",
			strings.Join(open, ", "), strings.Join(missing, " and "))
	}
	if c.TLS.IsZero() {
		if !c.ReplicaToken.IsZero() {
			return errors.New("--replica-token-file admits bus clients over TLS: it needs TLS material")
		}
		c.Insecure = true // loopback only: a local cluster
		c.Warnings = append(c.Warnings, "no TLS material: Raft, the bus and the cluster endpoints run without TLS or authentication (every address is loopback, so only this host can reach them); give --tls-ca/--tls-cert/--tls-key to secure them")
	}
	return nil
}

// httpScheme is how peers and tools reach this replica's HTTP port.
func (c *serveConfig) httpScheme() string {
	if c.Insecure {
		return "http"
	}
	return "https"
}

// readSecretFiles reads the *_FILE secrets (so they need not be on a
// command line, where every local user can read them). A secret given
// both inline and as a file is refused: which one wins would be a guess.
func (c *serveConfig) readSecretFiles(admin, worker, replica string) error {
	if admin != "" {
		if c.AdminToken != "" {
			return errors.New("give the admin token once: --admin-token or --admin-token-file")
		}
		s, err := pki.ReadSecretFile(admin)
		if err != nil {
			return fmt.Errorf("--admin-token-file: %w", err)
		}
		c.AdminToken = s.Reveal()
	}
	if worker != "" {
		if !c.WorkerAPIKey.IsZero() {
			return errors.New("give the worker API key once: --worker-api-key or --worker-api-key-file")
		}
		s, err := pki.ReadSecretFile(worker)
		if err != nil {
			return fmt.Errorf("--worker-api-key-file: %w", err)
		}
		c.WorkerAPIKey = s
	}
	if replica != "" {
		s, err := pki.ReadSecretFile(replica)
		if err != nil {
			return fmt.Errorf("--replica-token-file: %w", err)
		}
		c.ReplicaToken = s
	}
	return nil
}

func secret(p *pki.Secret) func(string) error {
	return func(v string) error { *p = pki.Secret(v); return nil }
}

// parseKeyInts reads KEY=N,….
func parseKeyInts(v string) (map[string]int, error) {
	out := map[string]int{}
	for _, item := range splitList(v) {
		k, n, ok := strings.Cut(item, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%q: want KEY=N", redactKey(item))
		}
		i, err := strconv.Atoi(n)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", redactKey(k), err)
		}
		out[k] = i
	}
	return out, nil
}

// redactKey shows only the start of an API key in an error.
func redactKey(k string) string {
	if len(k) <= 4 {
		return "****"
	}
	return k[:4] + "…"
}

func anyGiven(given map[string]bool, names []string) bool {
	for _, n := range names {
		if given[n] {
			return true
		}
	}
	return false
}

func envNote(env []string) string {
	if len(env) == 0 {
		return ""
	}
	return " (env " + strings.Join(env, ", ") + ")"
}

func parsePeers(v string) ([]cluster.Peer, error) {
	var out []cluster.Peer
	for _, item := range splitList(v) {
		id, addr, ok := strings.Cut(item, "=")
		if !ok || id == "" || addr == "" {
			return nil, fmt.Errorf("peer %q: want id=host:port", item)
		}
		out = append(out, cluster.Peer{ID: id, RaftAddr: addr})
	}
	return out, nil
}

// parseStatic reads --workers: id=URL entries, each optionally followed by
// its capacity as ;total_kv_blocks=N and ;max_num_batched_tokens=M (the
// registration API's names), e.g.
// "w0=http://gpu0:8000;total_kv_blocks=2048;max_num_batched_tokens=8192".
// A plain id=URL registers no capacity, as before: the capacity-relative
// settings then do not apply to it and say so (router/capacity.go).
func parseStatic(v string) ([]replica.StaticWorker, error) {
	var out []replica.StaticWorker
	for _, item := range splitList(v) {
		entry, caps, hasCaps := strings.Cut(item, ";")
		id, url, ok := strings.Cut(entry, "=")
		if !ok || id == "" || !strings.HasPrefix(url, "http") {
			return nil, fmt.Errorf("worker %q: want id=http://host:port[;total_kv_blocks=N][;max_num_batched_tokens=M]", item)
		}
		w := replica.StaticWorker{ID: id, URL: strings.TrimRight(url, "/")}
		if hasCaps {
			for _, kv := range strings.Split(caps, ";") {
				k, val, _ := strings.Cut(strings.TrimSpace(kv), "=")
				n, err := strconv.Atoi(val)
				if err != nil || n <= 0 {
					return nil, fmt.Errorf("worker %q: %q: want a positive count", item, kv)
				}
				switch k {
				case "total_kv_blocks":
					w.TotalBlocks = n
				case "max_num_batched_tokens":
					w.MaxBatchedTokens = n
				default:
					return nil, fmt.Errorf("worker %q: unknown capacity %q (want total_kv_blocks or max_num_batched_tokens)", item, k)
				}
			}
		}
		out = append(out, w)
	}
	return out, nil
}

// readWorkersFile reads --workers-file: one --workers entry per line.
func readWorkersFile(path string) ([]replica.StaticWorker, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--workers-file: %w", err)
	}
	var out []replica.StaticWorker
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if strings.Contains(line, ",") {
			return nil, fmt.Errorf("--workers-file %s:%d: one worker per line (no commas)", path, i+1)
		}
		ws, err := parseStatic(line)
		if err != nil {
			return nil, fmt.Errorf("--workers-file %s:%d: %w", path, i+1, err)
		}
		out = append(out, ws...)
	}
	return out, nil
}

func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func str(p *string) func(string) error { return func(v string) error { *p = v; return nil } }
func list(p *[]string) func(string) error {
	return func(v string) error { *p = splitList(v); return nil }
}
func intp(p *int) func(string) error {
	return func(v string) error {
		n, err := strconv.Atoi(v)
		*p = n
		return err
	}
}
func floatp(p *float64) func(string) error {
	return func(v string) error {
		f, err := strconv.ParseFloat(v, 64)
		*p = f
		return err
	}
}
func optFloat(p **float64) func(string) error {
	return func(v string) error {
		if isNone(v) { // Dynamo's "no threshold"
			*p = nil
			return nil
		}
		f, err := strconv.ParseFloat(v, 64)
		*p = &f
		return err
	}
}
func optInt(p **int64) func(string) error {
	return func(v string) error {
		if isNone(v) {
			*p = nil
			return nil
		}
		n, err := strconv.ParseInt(v, 10, 64)
		*p = &n
		return err
	}
}
func boolp(p *bool) func(string) error {
	return func(v string) error {
		b, err := strconv.ParseBool(v)
		*p = b
		return err
	}
}
func secs(p *time.Duration) func(string) error {
	return func(v string) error {
		f, err := strconv.ParseFloat(v, 64)
		*p = time.Duration(f * float64(time.Second))
		return err
	}
}
func dur(p *time.Duration) func(string) error {
	return func(v string) error {
		d, err := time.ParseDuration(v)
		*p = d
		return err
	}
}

// boolFlag is a flag.Value that may be given alone (--single-node).
type boolFlag struct{ set func(string) error }

func (b boolFlag) String() string     { return "" }
func (b boolFlag) Set(v string) error { return b.set(v) }
func (b boolFlag) IsBoolFlag() bool   { return true }
