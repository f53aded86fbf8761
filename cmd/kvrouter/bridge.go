package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/eventbus/zmqbridge"
	"github.com/kvrouter/kvrouter/router"
)

// bridgeConfig is everything `kvrouter bridge` is told.
type bridgeConfig struct {
	ConfigFile       string
	Worker           zmqbridge.WorkerSpec // from flags; ID "" = none
	BlockSize        int
	NATS             string
	Register         []string
	AdminToken       string
	RegisterInterval time.Duration
	HTTPAddr         string
	APIToken         string
	InsecureAPI      bool  // --insecure-api: register API open off loopback, on purpose
	MaxMessageBytes  int64 // ZMQ message cap (0: zmqbridge's default)
	ReplayTimeout    time.Duration
	LogLevel         slog.Level
	// LowerTiers (--kv-tiers) are the offload tiers whose KV events are
	// published with their tier; none by default (skipped as before).
	LowerTiers []router.Tier
	// BatchMessages (--batch-messages): one bus message per engine event
	// batch (eventbus's batch form).
	BatchMessages bool
	// CompactHashes (--compact-hashes): events' hashes in the compact form
	// (eventbus.WithCompactHashes).
	CompactHashes bool

	workers []zmqbridge.WorkerSpec // flags' worker plus the config file's
}

const bridgeEnvPrefix = "KVROUTER_BRIDGE_"

func bridgeEnv(flagName string) string {
	return bridgeEnvPrefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// parseBridge reads flags, then KVROUTER_BRIDGE_<FLAG> environment
// variables for flags not given, then the config file for settings given
// by neither.
func parseBridge(args []string, getenv func(string) string, stderr io.Writer) (bridgeConfig, error) {
	fs := flag.NewFlagSet("bridge", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		c                      bridgeConfig
		register, level, tiers string
	)
	w := &c.Worker
	fs.StringVar(&c.ConfigFile, "config", "", "JSON file listing workers (and optionally block_size, nats, register, admin_token)")
	fs.StringVar(&w.ID, "id", "", "worker id of the one engine given by flags (unique among the workers; no '#')")
	fs.StringVar(&w.URL, "url", "", "the engine's OpenAI base URL, e.g. http://gpu0:8000 (what the router routes to)")
	fs.StringVar(&w.Model, "model", "", "served model name (default: the first of GET <url>/v1/models)")
	fs.StringVar(&w.Events, "events", "", "the engine's KV event PUB socket, e.g. tcp://gpu0:5557 (its kv-events endpoint with the engine's host)")
	fs.StringVar(&w.Replay, "replay", "", "the engine's replay ROUTER socket, e.g. tcp://gpu0:5558 (its replay_endpoint; strongly advised)")
	fs.StringVar(&w.Topic, "topic", "", "the engine's kv-events topic (default: all)")
	fs.IntVar(&w.DPRanks, "dp-ranks", 1, "data-parallel ranks of the engine (rank r publishes at the endpoints' ports + r)")
	fs.IntVar(&w.TotalBlocks, "total-kv-blocks", 0, "KV cache capacity per rank in blocks (default: read from the engine's /metrics)")
	fs.IntVar(&w.MaxBatchedTokens, "max-batched-tokens", 0, "the engine's per-step token budget (vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size); engines do not export it, so 0 registers none and the router's --router-queue-threshold and --active-prefill-tokens-threshold-frac do not apply to this worker (warned)")
	fs.StringVar(&w.MetricsURL, "metrics-url", "", "the engine's Prometheus endpoint (default <url>/metrics)")
	fs.IntVar(&c.BlockSize, "block-size", 0, "tokens per KV block; must equal the router's and the engines' (default 16)")
	fs.StringVar(&c.NATS, "nats", "", "NATS URL(s) of the cluster's event bus, comma list (required)")
	fs.StringVar(&register, "register", "", "comma list of kvrouter replica base URLs to register the workers with (empty: do not register)")
	fs.StringVar(&c.AdminToken, "admin-token", "", "bearer token of the replicas' /workers endpoints (their --admin-token)")
	fs.DurationVar(&c.RegisterInterval, "register-interval", 30*time.Second, "registration lease renewal period")
	fs.StringVar(&c.HTTPAddr, "http-addr", "127.0.0.1:8090", "listen address of /status, /metrics and the register API (empty: none)")
	fs.StringVar(&c.APIToken, "api-token", "", "bearer token the bridge's POST /workers/* endpoints require (required off loopback unless --insecure-api)")
	fs.BoolVar(&c.InsecureAPI, "insecure-api", false, "let anyone who reaches --http-addr register workers without a token (on purpose)")
	fs.Int64Var(&c.MaxMessageBytes, "max-message-bytes", 0, "largest ZMQ message accepted from an engine, all frames (0: 16 MiB); a peer declaring more is dropped before anything is allocated")
	fs.DurationVar(&c.ReplayTimeout, "replay-timeout", 30*time.Second, "bound on one replay request to an engine")
	fs.BoolVar(&c.BatchMessages, "batch-messages", false, "publish each engine KV event batch (vLLM KVEventBatch) as one bus message of several events instead of one message per event: "+
		"fewer stream writes per event. Enable only once every replica runs a build that knows batch messages (older ones refuse them)")
	fs.BoolVar(&c.CompactHashes, "compact-hashes", false, "publish KV events' hashes in the compact form (16 bytes a block instead of 23, 8 a removed hash instead of 9; eventbus/DESIGN.md \"Compact hashes\"). "+
		"Enable only once every replica runs a build that knows it (older ones refuse such events)")
	fs.StringVar(&level, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&tiers, "kv-tiers", "", "offload tiers whose KV events are published with their tier, comma list of host, disk, external "+
		"(vLLM/KVBM media CPU and DISK, SGLang HiCache STORAGE): the router credits them at --router-host-cache-hit-weight and "+
		"--router-disk-cache-hit-weight. Default none: those events are skipped (other_medium). Enable only once every replica "+
		"runs a build with tiers: older builds halt on a tiered Raft entry")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: kvrouter bridge [flags]\n\n"+
			"Follows vLLM / SGLang KV events over ZMQ (--kv-events-config publisher zmq) and publishes them,\n"+
			"converted to the router's block hashes, into the cluster's event bus. One engine by flags\n"+
			"(--id --url --events --replay), many by --config, more at run time by POST /workers/register.\n"+
			"Every flag can also be set by %s<FLAG> (e.g. %sNATS); a flag on the command line wins.\n\n",
			bridgeEnvPrefix, bridgeEnvPrefix)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] {
			return
		}
		if v := getenv(bridgeEnv(f.Name)); v != "" {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: %w", bridgeEnv(f.Name), v, err))
			} else {
				given[f.Name] = true
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		return c, err
	}
	c.Register = splitComma(register)
	for _, name := range splitComma(tiers) {
		t, ok := parseTierName(name)
		if !ok {
			return c, fmt.Errorf("--kv-tiers: %q is not host, disk or external", name)
		}
		c.LowerTiers = append(c.LowerTiers, t)
	}
	if c.HTTPAddr != "" {
		if err := zmqbridge.CheckAPIListen(c.HTTPAddr, c.APIToken, c.InsecureAPI); err != nil {
			return c, err
		}
	}
	if c.ConfigFile != "" {
		fc, err := zmqbridge.LoadConfigFile(c.ConfigFile)
		if err != nil {
			return c, err
		}
		if !given["block-size"] && fc.BlockSize > 0 {
			c.BlockSize = fc.BlockSize
		}
		if !given["nats"] {
			c.NATS = fc.NATS
		}
		if !given["register"] && len(fc.Register) > 0 {
			c.Register = fc.Register
		}
		if !given["admin-token"] {
			c.AdminToken = fc.AdminToken
		}
		c.workers = append(c.workers, fc.Workers...)
	}
	if c.BlockSize == 0 {
		c.BlockSize = 16
	}
	if err := c.LogLevel.UnmarshalText([]byte(level)); err != nil {
		errs = append(errs, fmt.Errorf("--log-level: %w", err))
	}
	byFlags := w.ID != "" || w.URL != "" || w.Events != "" || w.Replay != ""
	if byFlags {
		if err := w.Normalize(); err != nil {
			errs = append(errs, fmt.Errorf("worker flags: %w", err))
		} else {
			for _, o := range c.workers {
				if o.ID == w.ID {
					errs = append(errs, fmt.Errorf("worker %s given by flags and in --config", w.ID))
				}
			}
			c.workers = append([]zmqbridge.WorkerSpec{*w}, c.workers...)
		}
	}
	if c.NATS == "" {
		errs = append(errs, errors.New("--nats is required: the bridge publishes into the cluster's event bus"))
	}
	if c.BlockSize <= 0 || c.BlockSize > eventbus.MaxBlockSize {
		errs = append(errs, fmt.Errorf("--block-size %d: must be in [1, %d]", c.BlockSize, eventbus.MaxBlockSize))
	}
	if len(c.workers) == 0 && c.HTTPAddr == "" {
		errs = append(errs, errors.New("no workers: give one by flags (--id --url --events), a --config, or an --http-addr to register them through"))
	}
	for _, u := range c.Register {
		if !strings.HasPrefix(u, "http://") && !strings.HasPrefix(u, "https://") {
			errs = append(errs, fmt.Errorf("--register %q: want an http(s):// base URL", u))
		}
	}
	if c.RegisterInterval <= 0 || c.ReplayTimeout <= 0 {
		errs = append(errs, errors.New("--register-interval and --replay-timeout must be positive"))
	}
	return c, errors.Join(errs...)
}

func splitComma(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimRight(strings.TrimSpace(p), "/"); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// runBridge is `kvrouter bridge`: a sidecar per worker, or one process for
// a fleet.
func runBridge(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parseBridge(args, getenvFunc, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "kvrouter bridge:", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: cfg.LogLevel}))
	nc, err := eventbus.Connect(cfg.NATS, "kvrouter-bridge", log)
	if err != nil {
		log.Error("cannot reach the event bus", "err", err)
		return 1
	}
	defer nc.Close()
	var popts []eventbus.PublisherOption
	if cfg.CompactHashes {
		popts = append(popts, eventbus.WithCompactHashes())
	}
	b, err := zmqbridge.New(zmqbridge.Config{
		BlockSize: cfg.BlockSize, Publishers: zmqbridge.NATSPublishers(nc, log, popts...), NATS: nc,
		Register: cfg.Register, AdminToken: cfg.AdminToken, RegisterInterval: cfg.RegisterInterval,
		ReplayTimeout: cfg.ReplayTimeout, Logger: log, InsecureAPI: cfg.InsecureAPI, MaxMessageBytes: cfg.MaxMessageBytes,
		LowerTiers: cfg.LowerTiers, BatchMessages: cfg.BatchMessages,
	})
	if err != nil {
		log.Error("cannot start", "err", err)
		return 1
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if cfg.HTTPAddr != "" {
		reg := prometheus.NewRegistry()
		reg.MustRegister(b.Collector(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		ln, err := net.Listen("tcp", cfg.HTTPAddr)
		if err != nil {
			log.Error("cannot listen", "addr", cfg.HTTPAddr, "err", err)
			return 1
		}
		srv := &http.Server{Handler: b.Handler(reg, cfg.APIToken), ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("http server", "err", err)
				cancel()
			}
		}()
		defer func() {
			sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer scancel()
			_ = srv.Shutdown(sctx)
		}()
		fmt.Fprintf(stdout, "kvrouter bridge: serving on http://%s\n", ln.Addr())
	}
	log.Info("bridge starting", "workers", len(cfg.workers), "block_size", cfg.BlockSize, "register", cfg.Register)
	if err := b.Run(ctx, cfg.workers); err != nil {
		log.Error("bridge failed", "err", err)
		return 1
	}
	return 0
}

// getenvFunc is os.Getenv (a variable so tests can replace it).
var getenvFunc = osGetenv

func osGetenv(k string) string { return os.Getenv(k) }

// parseTierName reads a lower tier's name (router.Tier's String).
func parseTierName(s string) (router.Tier, bool) {
	for t := router.TierHost; t < router.NumTiers; t++ {
		if strings.EqualFold(s, t.String()) {
			return t, true
		}
	}
	return 0, false
}
