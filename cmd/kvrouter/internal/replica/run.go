package replica

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/router"
)

// Run builds one replica from cfg — state machine, event bus, Raft node,
// the replica over them, the API server — and serves until ctx ends; then
// it drains (not ready, in-flight requests finish), hands leadership over
// and stops.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := os.MkdirAll(cfg.DataDir, 0o755); err != nil {
		return fmt.Errorf("data dir: %w", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	prompts, err := loadModels(cfg, log)
	if err != nil {
		return err
	}
	state, err := fsm.NewFSM(cfg.Router)
	if err != nil {
		return fmt.Errorf("state machine: %w", err)
	}
	state.SetDigestCheckpoints(cfg.DigestCheckpointEvery)

	// One load of the TLS material for Raft, the bus and HTTPS: all three
	// present the same node certificate.
	bundle, err := loadBundle(cfg)
	if err != nil {
		return err
	}
	members := newMembership(cfg)
	bus, err := openBus(cfg, bundle, members.isMember, log)
	if err != nil {
		return err
	}
	defer bus.Close()

	node, err := cluster.New(clusterConfig(cfg, bundle, state, reg, log), state)
	if err != nil {
		return fmt.Errorf("raft node: %w", err)
	}
	members.node.Store(node)
	groups, err := openGroups(cfg, bundle, state, reg, log)
	defer func() {
		for _, g := range groups {
			stopCtx, stop := context.WithTimeout(context.Background(), shutdownTimeout)
			if err := g.node.Shutdown(stopCtx); err != nil {
				log.Warn("raft shutdown", "group", g.id, "err", err)
			}
			stop()
		}
	}()
	if err != nil {
		return err
	}
	r, err := assemble(cfg, log, parts{reg: reg, fsm: state, node: node, bus: bus, prompts: prompts, tls: bundle, groups: groups})
	if err != nil {
		return err
	}
	if bundle != nil { // one bundle behind Raft, the bus and HTTPS: rotating it rotates all three
		go watchCertificate(ctx, bundle, reg, log.With("component", "certificate"))
	}

	decisions, closeDecisions, err := openDecisionLog(cfg, log.With("component", "decision-log"))
	if err != nil {
		return err
	}
	defer closeDecisions()
	capt, closeCapture, err := openCapture(cfg, log.With("component", "capture"))
	if err != nil {
		return err
	}
	defer closeCapture()

	wtls, err := workerTLS(cfg)
	if err != nil {
		return err
	}
	apiCfg := api.Config{
		BusyStatus: cfg.BusyStatus, AdminToken: cfg.AdminToken, AdminOpenToLoopback: cfg.AdminOpenToLoopback, APIKeys: cfg.APIKeys, ClientCert: apiClientCheck(cfg), Prompts: prompts,
		// /cluster/raft_groups: the control group's member certificate
		// (the admin token without TLS), as every other /cluster/ write.
		ClusterAuth:  node.CheckRequest,
		WorkerAPIKey: cfg.WorkerAPIKey.Reveal(), WorkerAPIKeys: revealAll(cfg.WorkerAPIKeys), WorkerTLS: wtls,
		Retries: cfg.Retries, AllowLoopbackWorkers: cfg.AllowLoopbackWorkers, MaxPriority: cfg.MaxPriority,
		MaxPriorityByKey: cfg.MaxPriorityByKey, MaxWorkers: cfg.MaxWorkers, MaxQueue: cfg.MaxQueue,
		WorkerHeaderTimeout: cfg.WorkerHeaderTimeout, WorkerIdleTimeout: cfg.WorkerIdleTimeout, ProtectStatus: cfg.ProtectStatus, MetricsCompat: cfg.MetricsCompat, MaxBodyBytes: cfg.MaxBodyBytes, Logger: log,
		Registry: reg, Decisions: decisions, Capture: capt, HitRateMaxBlocks: cfg.HitRateMaxBlocks, Tenants: r.tenants,
		WarmUpShare: cfg.WarmUpShare, WarmUpShadow: cfg.WarmUpShadow, ShadowInflight: cfg.ShadowInflight,
		DrainShadow: cfg.DrainShadow, SessionBodiesMaxBytes: cfg.SessionBodiesMaxBytes, ReservationTTL: cfg.ReservationTTL,
	}
	if bundle == nil {
		// Without TLS the admin token is the cluster endpoints' only
		// credential: the API mounts them behind it.
		apiCfg.ClusterHandler = clusterHandler(node, groups)
		apiCfg.ClusterGroups = len(groups)
	}
	srv := api.New(apiCfg, r)
	// The self-check and LoRA discovery reach workers as the proxy does:
	// its transport and the worker API key (selfcheck.go, lora.go).
	r.tokcheck.useWorkerAccess(srv.WorkerTransport(), srv.WorkerKey)
	r.loras.useWorkerAccess(srv.WorkerTransport(), srv.WorkerKey)
	handler := srv.Handler()
	if bundle != nil {
		handler = withClusterEndpoints(handler, clusterHandler(node, groups), len(groups))
	}
	ln, err := listenHTTP(cfg, bundle)
	if err != nil {
		return err
	}
	httpSrv := api.NewHTTPServer(closeWhileDraining(handler, &r.draining), api.ServerOptions{Logger: log})
	httpErr := make(chan error, 1)
	go func() { httpErr <- httpSrv.Serve(ln) }()
	var picker *extProcServer
	if cfg.ExtProcAddr != "" {
		ready := func() bool { ok, _ := r.Ready(); return ok }
		if picker, err = serveExtProc(cfg, bundle, srv, ready, log.With("component", "ext_proc")); err != nil {
			return err
		}
	}
	log.Info("replica serving", "http", cfg.HTTPAddr, "advertise", cfg.AdvertiseHTTP, "raft", cfg.RaftAddr, "nats", bus.ClientURL(), "mode", cfg.Router.Mode,
		"tls", bundle != nil, "plain_http", bundle == nil || cfg.AllowPlainHTTP, "admin_token", cfg.AdminToken != "", "worker_api_key", !cfg.WorkerAPIKey.IsZero(), "per_worker_api_keys", len(cfg.WorkerAPIKeys))

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	if cfg.PprofAddr != "" {
		if _, err := servePprof(runCtx, cfg.PprofAddr, log.With("component", "pprof")); err != nil {
			return err
		}
	}
	r.start(runCtx)

	if err := node.Form(runCtx); err != nil && runCtx.Err() == nil {
		return fmt.Errorf("forming the cluster: %w", err)
	}
	if err := formGroups(runCtx, groups); err != nil && runCtx.Err() == nil {
		return fmt.Errorf("forming the raft groups: %w", err)
	}
	if cfg.BridgeConfig != "" {
		wait, err := startReplicaBridge(runCtx, cfg.BridgeConfig, bus.Conn(), cfg.AdvertiseHTTP, cfg.AdminToken,
			cfg.Router.BlockSize, peerClient(bundle, bridgeHTTPTimeout), reg, log.With("component", "bridge"))
		if err != nil {
			return fmt.Errorf("engine bridge: %w", err)
		}
		defer func() { cancel(); wait() }()
	}
	select {
	case <-ctx.Done():
	case err := <-httpErr:
		log.Error("http server failed", "err", err)
	}
	// Drain: report not ready so the load balancer routes away. HAProxy
	// checks /ready?draining=404 and, on 404, stops sending new sessions
	// but keeps the open ones (disable-on-404); a 503 would mark us down and
	// cut them (on-marked-down shutdown-sessions). Keep-alives end, so
	// clients' pinned connections close after their current answer and
	// reconnect elsewhere. Then wait for in-flight requests before closing
	// the listener: a closed listener fails the checks and would cut the
	// streams still running.
	r.draining.Store(true) // closeWhileDraining: keep-alives end with each connection's next answer
	if cfg.DrainDelay > 0 {
		log.Info("draining: /ready is 503 (404 to the load balancer) while it moves away", "for", cfg.DrainDelay)
		time.Sleep(cfg.DrainDelay)
	}
	waitIdle(srv, cfg.DrainTimeout, log)
	stopCtx, stop := context.WithTimeout(context.Background(), shutdownTimeout)
	defer stop()
	if err := httpSrv.Shutdown(stopCtx); err != nil {
		log.Warn("http shutdown: in-flight requests cut", "err", err)
	}
	picker.stop(cfg.DrainTimeout)
	log.Info("shutting down: leadership transfer first")
	cancel()
	if err := node.Shutdown(stopCtx); err != nil {
		log.Warn("raft shutdown", "err", err)
	}
	return nil
}

// parts are what a replica is assembled over: Run builds them from the
// configuration; the package's tests build them over the cluster harness
// (cluster/clustertest) and a test NATS server.
type parts struct {
	reg     *prometheus.Registry
	fsm     *fsm.FSM
	node    *cluster.Node
	bus     *eventbus.Bus
	prompts *prompt.Set
	tls     *pki.Bundle  // nil: insecure (and the tests over the harness)
	groups  []*dataGroup // data groups of a sharded index (none: unsharded)
}

// assemble builds the replica over p: its routers (created per model on
// first use), worker health, prediction batcher, cache audit, tokenizer
// self-check, LoRA directory, tokenizer agreement and replica sync, and
// subscribes it to the FSM's changes. Nothing runs until start.
func assemble(cfg Config, log *slog.Logger, p parts) (*replica, error) {
	r := &replica{cfg: cfg, log: log, reg: p.reg, fsm: p.fsm, node: p.node, bus: p.bus, prompts: p.prompts,
		routers: map[string]*router.Router{}, disagg: map[string]*router.DisaggRouter{}, models: map[router.WorkerID]string{},
		ctl: newDataGroup(0, p.fsm, p.node), groups: p.groups}
	r.health = newWorkerHealth(cfg.EventsMissing, p.reg, log)
	r.preds = newPredictionBatcher(r, log)
	r.audit = newCacheAudit(log)
	r.capacity = newCapacityWatch(r.overCapacityRefused, p.reg, log.With("component", "index-cap"))
	r.gaps = newCapacityGaps(p.reg, log.With("component", "capacity"))
	r.tokcheck = newTokenizerCheck(cfg.TokenizerCheck, p.prompts.Lookup, r.workers, p.reg, log.With("component", "tokenizer-check"))
	r.loras = newLoRADirectory(log.With("component", "lora"))
	r.agree = newTokenizerAgreement(cfg.NodeID, p.reg, log.With("component", "tokenizer-agreement"))
	r.state = newStateAgreement(cfg.NodeID, p.fsm, p.reg, log.With("component", "state-agreement"))
	for _, g := range p.groups {
		r.state.groups = append(r.state.groups, stateGroup{g.id, g.fsm})
	}
	if p.tls != nil {
		r.agree.client = peerClient(p.tls, r.agree.client.Timeout) // peers advertise https://
		r.state.client = peerClient(p.tls, r.state.client.Timeout)
	}
	p.fsm.OnChange(r.onChange)
	for _, g := range p.groups {
		g.fsm.OnChange(func(ch fsm.Change) { r.onGroupChange(g, ch) })
	}

	var err error
	if cfg.InferencePool.Name != "" {
		if r.pool, err = newPoolWatcher(cfg, log.With("component", "inference-pool")); err != nil {
			return nil, err
		}
	}
	if r.tenants, err = api.NewTenantLedger(cfg.Tenants); err != nil {
		return nil, fmt.Errorf("tenants: %w", err)
	}
	syncCfg := eventbus.SyncConfig{Replica: cfg.NodeID, Registerer: p.reg, Logger: log}
	if r.tenants != nil {
		syncCfg.Tenants, syncCfg.TenantInterval, syncCfg.TenantsChanged = r.tenantUsage, cfg.TenantSyncInterval, r.tenants.Changed()
	}
	// Replica sync on a connection of its own without echo: the server
	// would otherwise send each replica every message it publishes (one
	// per request routed, at the moment the request goes out), to be read
	// and decoded only to be dropped by the syncer's own-replica check.
	syncConn, err := p.bus.Dial("sync", eventbus.WithNoEcho())
	if err != nil {
		return nil, fmt.Errorf("replica sync connection: %w", err)
	}
	r.sync, err = eventbus.NewSyncer(syncConn, syncCfg, r)
	if err != nil {
		return nil, fmt.Errorf("replica sync: %w", err)
	}
	return r, nil
}

// start hands the leader's duties to the node (lead runs whenever this
// replica leads) and starts the background work every replica does, until
// ctx ends. Call it before the node forms, so no leadership is missed.
func (r *replica) start(ctx context.Context) {
	r.node.WhileLeader(r.lead)
	for _, g := range r.groups {
		g.node.WhileLeader(func(ctx context.Context) { r.leadGroup(ctx, g) })
		go r.spreadLeadership(ctx, g)
	}
	go r.registerSelf(ctx)
	go r.registerStatic(ctx)
	if r.pool != nil {
		go r.watchPool(ctx)
	}
	go func() { _ = r.sync.Run(ctx) }()
	go r.preds.run(ctx)
	go r.health.run(ctx, r)
	go r.tokcheck.run(ctx)
	go r.loras.run(ctx, r.workers)
	if r.cfg.Insecure {
		go remindInsecure(ctx, r.log)
	}
	go r.agree.run(ctx, func() modelPrints { return printsOf(r.prompts.Describe(r.Models())) }, r.fsm.Nodes)
	go r.state.run(ctx, r.fsm.Nodes)
}

// waitIdle waits until srv serves no inference request, at most limit.
func waitIdle(srv *api.Server, limit time.Duration, log *slog.Logger) {
	deadline := time.Now().Add(limit)
	for n := srv.InFlight(); n > 0; n = srv.InFlight() {
		if time.Now().After(deadline) {
			log.Warn("drain timeout: closing with requests in flight", "in_flight", n, "after", limit)
			return
		}
		time.Sleep(drainPoll)
	}
}

// loadModels loads every --model-dir and the replica-wide --tokenizer /
// --chat-template the other models use. A broken directory stops the
// start, naming the file and the feature.
func loadModels(cfg Config, log *slog.Logger) (*prompt.Set, error) {
	tok, tmpl, err := loadTokenizer(cfg)
	if err != nil {
		return nil, err
	}
	var dirs []*prompt.Model
	listed := slices.Clone(cfg.Models)
	for _, d := range cfg.ModelDirs {
		m, err := prompt.Load(d.Name, d.Dir)
		if err != nil {
			return nil, fmt.Errorf("--model-dir: %w", err)
		}
		log.Info("model files loaded", "model", d.Name, "dir", d.Dir, "tokenizer", m.Tokenizer().Name(),
			"fingerprint", m.Fingerprint(), "chat_template", m.HasChatTemplate())
		dirs = append(dirs, m)
		listed = slices.DeleteFunc(listed, func(n string) bool { return n == d.Name })
	}
	return prompt.NewSet(listed, dirs, tok, tmpl, cfg.Tokenizer), nil
}

func loadTokenizer(cfg Config) (tokenize.Tokenizer, tokenize.Template, error) {
	var tok tokenize.Tokenizer = tokenize.Builtin()
	tmplName := cfg.ChatTemplate
	if cfg.Tokenizer != "" && cfg.Tokenizer != "builtin" {
		hf, err := tokenize.LoadHF(cfg.Tokenizer)
		if err != nil {
			return nil, 0, fmt.Errorf("tokenizer: %w", err)
		}
		tok = hf
		if tmplName == "" {
			tmplName = "chatml"
		}
	} else if tmplName == "" {
		tmplName = "plain"
	}
	tmpl, err := tokenize.ParseTemplate(tmplName)
	if err != nil {
		return nil, 0, fmt.Errorf("chat template: %w", err)
	}
	return tok, tmpl, nil
}

// openBus starts the embedded NATS server (or connects to --nats-url) with
// this replica's bundle: TLS on the client port and the routes, nodes
// admitted while isMember says they are cluster members, workers by their
// certificates, tools by the replica token when one is set.
func openBus(cfg Config, bundle *pki.Bundle, isMember func(string) bool, log *slog.Logger) (*eventbus.Bus, error) {
	host, port, err := splitHostPort(cfg.NATSAddr)
	if err != nil {
		return nil, fmt.Errorf("--nats-addr: %w", err)
	}
	sec := eventbus.Security{Insecure: bundle == nil}
	if bundle != nil {
		sec.Bundle, sec.ReplicaToken, sec.IsMember = bundle, cfg.ReplicaToken, isMember
	}
	sc := eventbus.ServerConfig{Name: cfg.NodeID, Host: host, Port: port, StoreDir: filepath.Join(cfg.DataDir, "jetstream"), Logger: log.With("component", "nats"),
		Security: sec}
	if !cfg.SingleNode && len(cfg.NATSRoutes) > 0 {
		ch, cp, err := splitHostPort(cfg.NATSClusterAddr)
		if err != nil {
			return nil, fmt.Errorf("--nats-cluster-addr: %w", err)
		}
		sc.ClusterName, sc.ClusterHost, sc.ClusterPort, sc.Routes = "kvrouter", ch, cp, cfg.NATSRoutes
	}
	// An external NATS (--nats-url) sees the same node certificate.
	client := eventbus.ClientSecurity{Insecure: bundle == nil, Bundle: bundle}
	bus, err := eventbus.OpenBus(eventbus.BusConfig{ExternalURL: cfg.NATSURL, Server: sc, Client: client, ClientName: cfg.NodeID, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("event bus: %w", err)
	}
	return bus, nil
}

func splitHostPort(addr string) (string, int, error) {
	h, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	var port int
	if _, err := fmt.Sscan(p, &port); err != nil {
		return "", 0, fmt.Errorf("port %q: %w", p, err)
	}
	return h, port, nil
}

// clusterConfig is the Raft node's configuration. With a bundle the Raft
// transport and the /cluster/ endpoints take member certificates only, and
// /cluster/apply takes only what replicas forward (checkForwarded).
func clusterConfig(cfg Config, bundle *pki.Bundle, state *fsm.FSM, reg prometheus.Registerer, log *slog.Logger) cluster.Config {
	c := cluster.DefaultConfig()
	c.NodeID, c.RaftAddr, c.DataDir, c.HTTPAddr = cfg.NodeID, cfg.RaftAddr, filepath.Join(cfg.DataDir, "raft"), cfg.AdvertiseHTTP
	c.AdvertiseAddr = cfg.AdvertiseRaft
	for _, p := range cfg.Peers {
		c.Peers = append(c.Peers, cluster.Peer{ID: p.ID, RaftAddr: p.RaftAddr})
	}
	if cfg.SingleNode && len(c.Peers) == 0 {
		c.Peers = []cluster.Peer{{ID: cfg.NodeID, RaftAddr: cfg.RaftAddr}}
	}
	c.Join = cfg.Join
	if cfg.SnapshotThreshold > 0 {
		c.SnapshotThreshold = cfg.SnapshotThreshold
	}
	c.AuthToken = cfg.AdminToken
	if bundle != nil {
		c.TLS = bundle
		c.CheckForwarded = checkForwarded
	}
	c.Logger = log.With("component", "raft")
	c.Registry = reg
	if cfg.RaftGroups > 1 {
		// Every group's metrics carry group="<g>" (Prometheus refuses one
		// name with and without the label): the control group is "0".
		// Unsharded, no label, as always.
		c.Group = "0"
	}
	overFSM(&c, state)
	return c
}

// overFSM ties a node's configuration to the state machine it replicates:
// leaders are found at the HTTP address the FSM's node registry holds
// (registerSelf puts it there), proposals are checked and results decoded
// the FSM's way. Run and the tests over the cluster harness share it.
func overFSM(c *cluster.Config, state *fsm.FSM) {
	c.LeaderHTTP = func(id string) string {
		rec, _ := state.Node(id)
		return rec.HTTPAddr
	}
	// A proposal whose time is far from the leader's clock (a forged Tick
	// or lease) is refused before it enters the log (fsm/DESIGN.md, "The clock").
	c.CheckCommand = func(cmd []byte) error { return fsm.CheckEntryTime(cmd, time.Now().UnixNano()) }
	c.ResponseError = fsm.ResponseError
	c.DecodeResult = fsm.DecodeResult
	c.ForwardErrors = fsm.ForwardErrors()
}

// remindInsecure repeats, every insecureReminder, that this replica's bus runs
// without TLS or authentication: an insecure cluster must never look like a
// secure one in the logs.
func remindInsecure(ctx context.Context, log *slog.Logger) {
	t := time.NewTicker(insecureReminder)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			log.Warn("INSECURE: the event bus runs without TLS or authentication (--insecure, or no TLS material on loopback)")
		}
	}
}

// revealAll turns per-worker secrets into the plain keys the API server
// sends (nil for none).
func revealAll(keys map[string]pki.Secret) map[string]string {
	if len(keys) == 0 {
		return nil
	}
	out := make(map[string]string, len(keys))
	for id, k := range keys {
		out[id] = k.Reveal()
	}
	return out
}
