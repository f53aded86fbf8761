package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/router"
)

// config is everything kvmock is told.
type config struct {
	ID           string
	Addr         string
	AdvertiseURL string // "" = http://<bound address>
	Model        string
	BlockSize    int
	KVBlocks     int
	// HostTierBlocks is the CPU offload tier's size in blocks (hosttier.go);
	// 0 = no host tier.
	HostTierBlocks   int
	MaxBatchedTokens int
	MaxRunning       int
	MaxModelLen      int // 0 = the whole cache
	Profile          string
	SchedulingPolicy string // --scheduling-policy: engine.Config.Scheduling
	Speedup          float64
	EngineHashSeed   uint64
	ChatTemplate     tokenize.Template
	// ModelDir is a Hugging Face model directory whose tokenizer and chat
	// template tokenize prompts, as the router's --model-dir does ("" = the
	// builtin tokenizer and ChatTemplate).
	ModelDir string
	// ChatTemplateFile replaces ModelDir's chat template, as vLLM's
	// --chat-template does: a deliberate way to make the engine's prompts
	// drift from the router's (the replicas' self-check must catch it).
	ChatTemplateFile string

	NATS       string // comma list of NATS URLs; "" = publish no events
	EventQueue int    // events buffered for the publisher before a full resync replaces them
	// EventsPerMsg > 1 coalesces KV events into batch messages of up to
	// this many (eventbus.WithBatching, 1 ms linger); 1: one per message.
	EventsPerMsg int
	// CompactHashes publishes events' hashes in the compact form
	// (eventbus.WithCompactHashes).
	CompactHashes bool
	// EventIDStart is the first KV event id; 0 = microseconds since the
	// Unix epoch at startup (unique per run).
	EventIDStart uint64
	Register     []string // kvrouter replica base URLs
	// AdminToken is the bearer token of the replicas' admin endpoints.
	AdminToken string
	// DPRanks is the data-parallel ranks served behind this one URL (dp.go);
	// DPRank is which one a Mock is (set internally, not a flag).
	DPRanks int
	DPRank  uint32
	// APIKey, when set, is the bearer token /v1/* requires (vLLM's
	// --api-key; apikey.go).
	APIKey string
	// NATSTLS is the worker's certificate, key and the cluster's CA for a
	// secure bus (kvrouter certs --workers <id>); zero = plaintext.
	NATSTLS pki.Material
	// RegisterCA is the CA file trusted for https:// --register URLs
	// (default NATSTLS.CAFile).
	RegisterCA string
	// RegisterInterval is the lease renewal period.
	RegisterInterval time.Duration
	ShutdownTimeout  time.Duration

	// Disaggregated prefill/decode (see DESIGN.md, "Disaggregation").
	Role router.Role // prefill, decode or both
	// KVBytesPerToken is one token's KV cache size: a pull of N tokens
	// moves N times this over the link.
	KVBytesPerToken int64
	// LinkMBps is the outgoing KV link's throughput in MB/s (1e6 bytes/s),
	// shared fairly by the transfers on it; 0 = infinite.
	LinkMBps float64
	// LinkMaxTransfers move bytes at once; later ones queue (0 = no limit).
	LinkMaxTransfers int
	// KVPullTimeout bounds a decode worker's pull from a prefill worker.
	KVPullTimeout time.Duration
	// KVTransferTTL is how long a prefill worker keeps an unpulled transfer.
	KVTransferTTL time.Duration

	Seed     uint64
	LogLevel slog.Level
}

// envPrefix + the flag name upper-cased with '-' → '_' is each flag's
// environment variable (--kv-blocks ↔ KVMOCK_KV_BLOCKS).
const envPrefix = "KVMOCK_"

func envName(flagName string) string {
	return envPrefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// parseConfig reads flags, then the environment for flags not given on the
// command line. flag.ErrHelp means -h was asked for (usage already printed).
func parseConfig(args []string, getenv func(string) string, stderr io.Writer) (config, error) {
	fs := flag.NewFlagSet("kvmock", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		c                           config
		register, level, tmpl, role string
		adminTokenFile, apiKeyFile  string
	)
	fs.StringVar(&c.ID, "id", "mock-1", "worker id (unique among the workers; no '#')")
	fs.StringVar(&c.Addr, "addr", "127.0.0.1:9001", "HTTP listen address")
	fs.StringVar(&c.AdvertiseURL, "advertise-url", "", "base URL the routers reach this worker at (default http://<addr>)")
	fs.StringVar(&c.Model, "model", "kvmock", "model name served and registered")
	fs.IntVar(&c.BlockSize, "block-size", 16, "tokens per KV block (must equal the router's)")
	fs.IntVar(&c.KVBlocks, "kv-blocks", 4096, "KV cache capacity in blocks")
	fs.IntVar(&c.HostTierBlocks, "host-tier-blocks", 0, "CPU offload tier in blocks, as vLLM's KV offloading to CPU: blocks evicted from the GPU cache move into a host LRU of this size (KV events with the host tier), and a prompt continuing there past its GPU hit loads them instead of computing them (0: no host tier; publish host-tier events only to replicas that know storage tiers)")
	fs.IntVar(&c.MaxBatchedTokens, "max-batched-tokens", engine.DefaultMaxBatchedTokens, "token budget per engine step (vLLM max_num_batched_tokens)")
	fs.IntVar(&c.MaxRunning, "max-running", engine.DefaultMaxRunning, "max running sequences (vLLM max_num_seqs)")
	fs.IntVar(&c.MaxModelLen, "max-model-len", 0, "max prompt+output tokens of one request (0 = kv-blocks*block-size)")
	fs.StringVar(&c.SchedulingPolicy, "scheduling-policy", engine.SchedulingFCFS, "waiting-queue policy, vLLM's --scheduling-policy: fcfs, priority (the request field priority orders the waiting queue, lower first; a KV shortage preempts the least urgent) or priority-preempt (also preempts the least urgent running request for a more urgent waiting one when the running set is full, as SGLang and vLLM v0 do); under fcfs a non-zero priority is refused with 400, as vLLM refuses it")
	fs.StringVar(&c.Profile, "profile", engine.ProfileDynamoMocker, "timing profile: "+strings.Join(engine.Profiles(), ", "))
	fs.Float64Var(&c.Speedup, "speedup", 1, "divides every engine step time (> 0)")
	fs.Uint64Var(&c.EngineHashSeed, "engine-hash-seed", 0, "0: name blocks in events by the content hash; else by an opaque seeded hash (exercises the router's engine→content mapping)")
	fs.StringVar(&tmpl, "chat-template", "plain", "chat template for rendering messages with the builtin tokenizer: plain or chatml (must equal the router's; its default for the builtin tokenizer is plain); ignored with --model-dir")
	fs.StringVar(&c.ModelDir, "model-dir", "", "Hugging Face model directory (tokenizer.json, tokenizer_config.json, chat template): prompts are tokenized with its files exactly as a router started with --model-dir NAME=DIR does, and /tokenize answers with them (empty: the builtin tokenizer)")
	fs.StringVar(&c.ChatTemplateFile, "chat-template-file", "", "with --model-dir: a Jinja chat template file used instead of the directory's, as vLLM's --chat-template (a template the routers do not have makes prompts drift: their self-check reports it)")
	fs.StringVar(&c.NATS, "nats", "", "NATS URL(s) of the cluster's JetStream, comma list (empty: no KV events are published)")
	fs.BoolVar(&c.CompactHashes, "compact-hashes", false, "publish KV events' hashes in the compact form (8 bytes a block instead of 23: about half the bytes for the stream; only replicas that know the compact form accept them)")
	fs.IntVar(&c.EventsPerMsg, "events-per-msg", 1, "KV events per bus message: more than 1 coalesces consecutive events into batch messages of up to this many, each sent at the latest 1 ms after its first event (fewer stream writes per event; only replicas that know batch messages accept them)")
	fs.IntVar(&c.EventQueue, "event-queue", 65536, "KV events buffered while NATS is slow or down; on overflow they are replaced by a full-state resync")
	fs.Uint64Var(&c.EventIDStart, "event-id-start", 0, "first KV event id (0: microseconds since the epoch at startup, so no run reuses an earlier run's ids, which the stream would drop as duplicates; the cluster resyncs the worker once at its first event)")
	fs.StringVar(&register, "register", "", "comma list of kvrouter replica base URLs to register with (empty: do not register)")
	fs.StringVar(&c.AdminToken, "admin-token", "", "bearer token for the replicas' /workers endpoints (their --admin-token), if they require one (prefer --admin-token-file)")
	fs.IntVar(&c.DPRanks, "dp-ranks", 1, "data-parallel ranks behind this URL, each with its own engine, cache and KV event stream (dp_rank in its events); with more than one, /v1/* needs the X-data-parallel-rank header (vLLM's and SGLang's) and answers 400 without it or for a rank not served")
	fs.StringVar(&c.APIKey, "api-key", "", "as vLLM's --api-key: /v1/* answers 401 without \"Authorization: Bearer <key>\" (prefer --api-key-file: argv is visible to every local user)")
	fs.StringVar(&apiKeyFile, "api-key-file", "", "file holding the API key (instead of --api-key)")
	fs.StringVar(&adminTokenFile, "admin-token-file", "", "file holding the admin token (instead of --admin-token: argv is visible to every local user)")
	fs.StringVar(&c.NATSTLS.CAFile, "nats-tls-ca", "", "CA certificate of the cluster (PEM) for a secure bus; with --nats-tls-cert and --nats-tls-key")
	fs.StringVar(&c.NATSTLS.CertFile, "nats-tls-cert", "", "this worker's certificate (PEM, identity spiffe://kvrouter/worker/<id>: kvrouter certs --workers <id>)")
	fs.StringVar(&c.NATSTLS.KeyFile, "nats-tls-key", "", "this worker's private key (PEM)")
	fs.StringVar(&c.RegisterCA, "register-ca", "", "CA certificate trusted for https:// --register URLs (default --nats-tls-ca)")
	fs.DurationVar(&c.RegisterInterval, "register-interval", 30*time.Second, "registration lease renewal period")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", 10*time.Second, "on SIGINT/SIGTERM: how long to let requests finish and events flush")
	fs.StringVar(&role, "role", "both", "disaggregated serving role: prefill (answers kv_transfer_params.do_remote_decode prefills and serves their KV on /kv/pull), decode (pulls the KV of do_remote_prefill requests) or both; every role also serves plain requests")
	fs.Int64Var(&c.KVBytesPerToken, "kv-bytes-per-token", router.KVQwen3_0_6B.BytesPerToken(), "KV cache bytes of one token, moved per transferred token (default Qwen3-0.6B: 28 layers x 8 KV heads x 128 x 2 x 2)")
	fs.Float64Var(&c.LinkMBps, "link-mbps", 0, "outgoing KV link throughput in MB/s (1e6 bytes/s), shared fairly by concurrent transfers and multiplied by --speedup (0: infinite, pulls answer at once)")
	fs.IntVar(&c.LinkMaxTransfers, "link-max-transfers", 0, "KV transfers moving bytes at once on the link; the others queue (0: no limit)")
	fs.DurationVar(&c.KVPullTimeout, "kv-pull-timeout", 30*time.Second, "decode role: how long a KV pull from the prefill worker may take before the request fails with 502")
	fs.DurationVar(&c.KVTransferTTL, "kv-transfer-ttl", 60*time.Second, "prefill role: how long a prefilled request's KV waits to be pulled before its transfer id is forgotten")
	fs.Uint64Var(&c.Seed, "seed", 1, "seed of the generated output text")
	fs.StringVar(&level, "log-level", "info", "debug, info, warn or error")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "kvmock: a simulated inference worker (OpenAI HTTP API + KV events)\n\nUsage: kvmock [flags]\n\nEvery flag can also be set by the environment variable KVMOCK_<NAME> (e.g. KVMOCK_KV_BLOCKS); a flag on the command line wins.\n\nDisaggregated serving (vLLM NIXL proxy protocol): --role prefill answers requests carrying kv_transfer_params.do_remote_decode with kv_transfer_params for the decode worker and serves their KV on GET /kv/pull over one simulated link (--link-mbps, --link-max-transfers, --kv-bytes-per-token); --role decode pulls that KV for requests carrying do_remote_prefill (502 kv_transfer_failed if it cannot). Every role serves plain requests.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] {
			return
		}
		if v := getenv(envName(f.Name)); v != "" {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: %w", envName(f.Name), v, err))
			}
		}
	})
	if len(errs) > 0 {
		return config{}, errors.Join(errs...)
	}
	for _, u := range strings.Split(register, ",") {
		if u = strings.TrimRight(strings.TrimSpace(u), "/"); u != "" {
			c.Register = append(c.Register, u)
		}
	}
	if apiKeyFile != "" {
		if c.APIKey != "" {
			errs = append(errs, errors.New("give the API key once: --api-key or --api-key-file"))
		} else if tok, err := pki.ReadSecretFile(apiKeyFile); err != nil {
			errs = append(errs, fmt.Errorf("--api-key-file: %w", err))
		} else {
			c.APIKey = tok.Reveal()
		}
	}
	if adminTokenFile != "" {
		if c.AdminToken != "" {
			errs = append(errs, errors.New("give the admin token once: --admin-token or --admin-token-file"))
		} else if tok, err := pki.ReadSecretFile(adminTokenFile); err != nil {
			errs = append(errs, fmt.Errorf("--admin-token-file: %w", err))
		} else {
			c.AdminToken = tok.Reveal()
		}
	}
	c.NATS = strings.Join(splitList(c.NATS), ",")
	c.AdvertiseURL = strings.TrimRight(strings.TrimSpace(c.AdvertiseURL), "/")
	var err error
	if c.ChatTemplate, err = tokenize.ParseTemplate(tmpl); err != nil {
		errs = append(errs, err)
	}
	if c.Role, err = parseRole(role); err != nil {
		errs = append(errs, err)
	}
	if err := c.LogLevel.UnmarshalText([]byte(level)); err != nil {
		errs = append(errs, fmt.Errorf("--log-level: %w", err))
	}
	errs = append(errs, c.validate(), c.checkSecurity())
	if err := errors.Join(errs...); err != nil {
		return config{}, err
	}
	return c, nil
}

// parseRole accepts the router's role names (router.ParseRole) but not an
// empty one: --role "" is more likely a mistake than a wish for "both".
func parseRole(s string) (router.Role, error) {
	r, err := router.ParseRole(s)
	if err != nil || strings.TrimSpace(s) == "" {
		return "", fmt.Errorf("--role %q: want prefill, decode or both", s)
	}
	return r, nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func (c config) validate() error {
	var errs []error
	probe := eventbus.WireEvent{Worker: c.ID, EventID: 1, Kind: eventbus.KindCleared}
	if err := eventbus.Validate(&probe, 0); err != nil || strings.Contains(c.ID, "#") {
		errs = append(errs, fmt.Errorf("--id %q: must be non-empty, printable, at most %d bytes, without '#'", c.ID, eventbus.MaxWorkerNameLen))
	}
	if c.Model == "" {
		errs = append(errs, errors.New("--model must not be empty"))
	}
	if c.DPRanks < 1 || c.DPRanks > maxDPRanks {
		errs = append(errs, fmt.Errorf("--dp-ranks %d: must be in [1, %d]", c.DPRanks, maxDPRanks))
	}
	if c.BlockSize <= 0 || c.BlockSize > eventbus.MaxBlockSize {
		errs = append(errs, fmt.Errorf("--block-size %d: must be in [1, %d]", c.BlockSize, eventbus.MaxBlockSize))
	}
	if c.EventsPerMsg < 1 || c.EventsPerMsg > eventbus.MaxBatchEvents {
		errs = append(errs, fmt.Errorf("--events-per-msg %d: must be in [1, %d]", c.EventsPerMsg, eventbus.MaxBatchEvents))
	}
	if c.KVBlocks <= 0 {
		errs = append(errs, fmt.Errorf("--kv-blocks %d: must be positive", c.KVBlocks))
	}
	if c.HostTierBlocks < 0 {
		errs = append(errs, fmt.Errorf("--host-tier-blocks %d: must not be negative (0 = no host tier)", c.HostTierBlocks))
	}
	if c.MaxBatchedTokens <= 0 || c.MaxRunning <= 0 || c.MaxModelLen < 0 {
		errs = append(errs, errors.New("--max-batched-tokens and --max-running must be positive, --max-model-len not negative"))
	}
	if _, err := engine.LookupProfile(c.Profile); err != nil {
		errs = append(errs, fmt.Errorf("--profile: %w", err))
	}
	switch c.SchedulingPolicy {
	case engine.SchedulingFCFS, engine.SchedulingPriority, engine.SchedulingPriorityPreempt:
	default:
		errs = append(errs, fmt.Errorf("--scheduling-policy %q: want %s, %s or %s", c.SchedulingPolicy,
			engine.SchedulingFCFS, engine.SchedulingPriority, engine.SchedulingPriorityPreempt))
	}
	if !(c.Speedup > 0) {
		errs = append(errs, fmt.Errorf("--speedup %v: must be positive", c.Speedup))
	}
	if c.EventQueue <= 0 {
		errs = append(errs, fmt.Errorf("--event-queue %d: must be positive", c.EventQueue))
	}
	if c.RegisterInterval <= 0 || c.ShutdownTimeout <= 0 {
		errs = append(errs, errors.New("--register-interval and --shutdown-timeout must be positive"))
	}
	if c.KVBytesPerToken <= 0 {
		errs = append(errs, fmt.Errorf("--kv-bytes-per-token %d: must be positive", c.KVBytesPerToken))
	}
	if !(c.LinkMBps >= 0) || math.IsInf(c.LinkMBps, 0) {
		errs = append(errs, fmt.Errorf("--link-mbps %v: must be finite and not negative (0 = infinite)", c.LinkMBps))
	}
	if c.LinkMaxTransfers < 0 {
		errs = append(errs, fmt.Errorf("--link-max-transfers %d: must not be negative (0 = no limit)", c.LinkMaxTransfers))
	}
	if c.ChatTemplateFile != "" && c.ModelDir == "" {
		errs = append(errs, errors.New("--chat-template-file needs --model-dir (the builtin tokenizer knows only --chat-template plain or chatml)"))
	}
	if c.KVPullTimeout <= 0 || c.KVTransferTTL <= 0 {
		errs = append(errs, errors.New("--kv-pull-timeout and --kv-transfer-ttl must be positive"))
	}
	for _, u := range c.Register {
		if !strings.HasPrefix(u, "http://") && !strings.HasPrefix(u, "https://") {
			errs = append(errs, fmt.Errorf("--register %q: want an http(s):// base URL", u))
		}
	}
	return errors.Join(errs...)
}

// engineConfig is the simulator's configuration.
func (c config) engineConfig() engine.Config {
	return engine.Config{
		BlockSize:        c.BlockSize,
		CapacityBlocks:   c.KVBlocks,
		MaxRunning:       c.MaxRunning,
		MaxBatchedTokens: c.MaxBatchedTokens,
		MaxModelLen:      c.MaxModelLen,
		Profile:          c.Profile,
		Scheduling:       c.SchedulingPolicy,
		Speedup:          c.Speedup,
		EngineHashSeed:   c.EngineHashSeed,
	}
}
