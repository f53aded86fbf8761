package replica

import (
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/cmd/internal/disaggflag"
	"github.com/kvrouter/kvrouter/cmd/kvrouter/internal/k8spool"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/router"
)

// Config is everything one replica is told. `kvrouter serve` fills it from
// flags and environment (cmd/kvrouter/config.go, dynamo.go), validated and
// with derived defaults filled; Run trusts it.
type Config struct {
	NodeID          string
	DataDir         string
	HTTPAddr        string // listen address
	AdvertiseHTTP   string // base URL other replicas and tools use
	RaftAddr        string
	AdvertiseRaft   string         // Raft address peers dial (default RaftAddr)
	NATSAddr        string         // embedded NATS client listen address
	NATSClusterAddr string         // embedded NATS cluster (routes) listen address
	NATSRoutes      []string       // peers' cluster addresses (nats://host:port)
	NATSURL         string         // external NATS cluster instead of the embedded one
	Peers           []cluster.Peer // expected initial Raft members
	Join            []string       // HTTP URLs of replicas to join through
	SingleNode      bool
	// RaftGroups shards the block index (issue 19): 1 (the default) is
	// one Raft group holding everything, as before; G > 1 runs a control
	// group (nodes, configuration, the worker placement map) and G data
	// groups, each with its own log, snapshots, FSM, stream and consumer,
	// on Raft port + g×RaftGroupPortStep and under data-dir/raft-g<g>.
	// Every replica of a cluster must run the same G.
	RaftGroups        int
	RaftGroupPortStep int // default 100

	Models        []string
	ModelDirs     []ModelDir // models with their own Hugging Face files
	Tokenizer     string     // "builtin" or a path to tokenizer.json
	ChatTemplate  string
	Router        router.Config
	BusyStatus    int
	AdminToken    string
	APIKeys       []string
	StaticWorkers []StaticWorker
	// InferencePool is a GAIE InferencePool whose Ready pods are workers
	// (k8spool; zero: none), read with Kubeconfig or, when empty, the
	// in-cluster service account. The control group's leader registers
	// and deregisters them (pool.go).
	InferencePool k8spool.Ref
	Kubeconfig    string
	// kube, when set, are the Kubernetes clients the pool is read with
	// instead of Kubeconfig's (tests: client-go's fakes).
	kube          *kubeClients
	Retries       int
	MaxBodyBytes  int64
	EventsMissing time.Duration       // warn when a kv-mode worker publishes nothing this long
	BridgeConfig  string              // engines whose ZMQ KV events this replica bridges itself (small fleets)
	DrainDelay    time.Duration       // on SIGTERM, /ready is 503 this long before the server stops
	DrainTimeout  time.Duration       // then in-flight requests get this long before the listener closes
	Disagg        disaggflag.Settings // --disagg and its knobs
	// Security (SECURITY.md): node certificate, key and CA for Raft, the
	// bus and HTTPS; Insecure is the explicit opt-out (no TLS anywhere).
	TLS      pki.Material
	Insecure bool
	// AllowPlainHTTP also serves plaintext HTTP on the HTTPS port (default
	// only when --http-addr is loopback). /cluster/* refuses it regardless.
	AllowPlainHTTP bool
	// WorkerTLSCA is a PEM file of the CAs https:// workers' certificates
	// must chain to (--worker-tls-ca), instead of the system roots.
	WorkerTLSCA string
	// WorkerAPIKey is sent to workers as their bearer token; ReplicaToken
	// admits bus clients without a certificate with a replica's rights
	// (tools such as kvbench ingest). Both print as [redacted].
	WorkerAPIKey pki.Secret
	// WorkerAPIKeys are per-worker keys (worker id → key, from
	// --worker-api-keys-file), sent instead of WorkerAPIKey to the workers
	// they name. They stay on this host: never in a registration, the Raft
	// log, a snapshot or /cluster/status.
	WorkerAPIKeys map[string]pki.Secret
	ReplicaToken  pki.Secret

	// AdminOpenToLoopback are admin paths served without AdminToken to
	// loopback callers (api.Config.AdminOpenToLoopback; kvrouter serve
	// --admin-open-to-loopback, loopback --http-addr only).
	AdminOpenToLoopback []string

	// Bounds (api/DESIGN.md, "Bounds").
	AllowLoopbackWorkers bool           // workers on loopback/link-local addresses (default: only when --http-addr is loopback)
	MaxPriority          int            // highest client priority (default: no cap, as Dynamo)
	MaxPriorityByKey     map[string]int // per API key
	MaxWorkers           int
	MaxQueue             int
	WorkerHeaderTimeout  time.Duration
	WorkerIdleTimeout    time.Duration
	ProtectStatus        bool
	// ExtProcAddr serves the endpoint picker (api/extproc) when set, with
	// ExtProcFallbacks endpoints after the choice; ReservationTTL is
	// api.Config.ReservationTTL (the selection API).
	ExtProcAddr      string
	ExtProcFallbacks int
	ReservationTTL   time.Duration
	APIClientCerts   bool // a verified pki.RoleClient certificate on the inference endpoints (needs TLS)
	// MetricsCompat is api.Config.MetricsCompat (--metrics-compat).
	MetricsCompat string
	// Tenants configures tenant fairness and budgets (api.TenantConfig:
	// --tenant-from, --tenant-header, --tenant-max, --tenant-metrics-max,
	// --tenant-tokens-per-minute, --tenant-max-concurrent,
	// --tenant-fair-slack); From none or empty turns it off.
	// TenantSyncInterval is how often tenant usage goes out on replica
	// sync when it changed (default 100 ms).
	Tenants            api.TenantConfig
	TenantSyncInterval time.Duration
	// The decision log (api/decisionlog): the newest DecisionLogSize
	// decisions in memory (0: off), and a JSON-lines file rotated at
	// DecisionLogMaxBytes when DecisionLogFile is set.
	DecisionLogSize     int
	DecisionLogFile     string
	DecisionLogMaxBytes int64
	// HitRateMaxBlocks is api.Config.HitRateMaxBlocks (--hit-rate-max-blocks:
	// 0 the default bound, negative off).
	HitRateMaxBlocks int
	// WarmUpShare is api.Config.WarmUpShare (--router-warmup-share; 0 off).
	WarmUpShare float64
	// WarmUpShadow and ShadowInflight are api.Config's
	// (--router-warmup-shadow, --router-shadow-inflight).
	WarmUpShadow   bool
	ShadowInflight int
	// DrainShadow and SessionBodiesMaxBytes are api.Config's
	// (--router-drain-shadow, --router-session-bodies-max-bytes).
	DrainShadow           bool
	SessionBodiesMaxBytes int64
	// The traffic capture (api/capture): answered requests as a
	// replayable trace in CaptureFile (off when empty), the CaptureSample
	// fraction of prefixes, rotated at CaptureMaxBytes.
	CaptureFile     string
	CaptureSample   float64
	CaptureMaxBytes int64
	// BusConsumerFileState keeps the durable KV event consumer's state in
	// files, as builds before issue 31's memory state did
	// (eventbus.ConsumerConfig.FileState): for a rolling upgrade from such
	// a build, whose leaders cannot use a durable with memory state.
	BusConsumerFileState bool
	// PprofAddr, when set, serves Go's profiler on this loopback address
	// (--pprof-addr; pprof.go).
	PprofAddr string
	// Dynamo's names with our meaning (cmd/kvrouter/dynamo.go).
	SnapshotThreshold uint64 // Raft entries between snapshots (0: cluster default)
	// DigestCheckpointEvery: the FSM digests its state after every entry
	// whose index is a multiple of it (fsm.SetDigestCheckpoints), so the
	// replicas can compare states while entries keep coming (0: off).
	// Every replica must use the same value to compare.
	DigestCheckpointEvery uint64
	MinInitialWorkers     int // not ready below this many registered workers

	// MaxEntryBytes caps one KV batch entry in the Raft log
	// (--max-entry-bytes; 0: DefaultMaxEntryBytes): larger batches are
	// split (bounds.go).
	MaxEntryBytes int

	// TokenizerCheck is how often each worker's /tokenize is compared with
	// our ids (besides at registration); 0 = never (selfcheck.go).
	TokenizerCheck time.Duration

	// Sessions is session affinity (sessions.go; Dynamo's
	// --router-session-affinity-ttl-secs and -mode).
	Sessions SessionConfig

	// Pins is --enable-agentic-cache-control: prefix pins from
	// nvext.cache_control (pins.go).
	Pins bool
}

// ModelDir is one --model-dir NAME=DIR.
type ModelDir struct{ Name, Dir string }

// StaticWorker is one --workers entry: registered for the first model,
// without a lease.
type StaticWorker struct {
	ID, URL string
	// The worker's capacity, as a registration carries it; 0: not given
	// (the capacity-relative settings do not apply to it, and say so).
	TotalBlocks, MaxBatchedTokens int
}

// clusteredStreamReplicas is how many NATS servers keep the KV_EVENTS
// stream when the embedded servers are clustered (--nats-routes). The
// documented cluster is three replicas, each with its own server: three
// copies survive the loss of any one server with a majority left, as the
// three-member Raft group does.
const clusteredStreamReplicas = 3

// streamReplicas is the KV_EVENTS replication the leader asks for: a
// replica without routes (--single-node, or an external or lone server)
// may have one server only, which can keep one copy.
func streamReplicas(cfg Config) int {
	if cfg.SingleNode || len(cfg.NATSRoutes) == 0 {
		return 1
	}
	return clusteredStreamReplicas
}
