package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/cluster"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/fsm"
	"github.com/kvrouter/kvrouter/router"
)

// runServe parses the configuration, builds the replica and serves until
// SIGINT/SIGTERM, then hands leadership over and stops.
func runServe(ctx context.Context, args []string, _, stderr io.Writer) int {
	cfg, err := parseServe(args, os.Getenv, stderr)
	if err != nil {
		if errors.Is(err, errHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "kvrouter serve: %v\n", err)
		return 2
	}
	log := newLogger(cfg.LogLevel, cfg.NodeID, stderr)
	for _, w := range cfg.Warnings {
		log.Warn("Dynamo option does not work as in Dynamo here", "detail", w)
	}
	if err := serve(ctx, cfg, log); err != nil {
		log.Error("replica stopped", "err", err)
		return 1
	}
	return 0
}

var errHelp = errors.New("help requested")

func newLogger(level, node string, w io.Writer) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})).With("node", node)
}

// serve runs one replica until ctx ends.
func serve(ctx context.Context, cfg serveConfig, log *slog.Logger) error {
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

	bus, err := openBus(cfg, log)
	if err != nil {
		return err
	}
	defer bus.Close()

	node, err := cluster.New(clusterConfig(cfg, state, reg, log), state)
	if err != nil {
		return fmt.Errorf("raft node: %w", err)
	}
	r := &replica{cfg: cfg, log: log, reg: reg, fsm: state, node: node, bus: bus, prompts: prompts,
		routers: map[string]*router.Router{}, disagg: map[string]*router.DisaggRouter{}, models: map[router.WorkerID]string{}}
	r.health = newWorkerHealth(cfg.EventsMissing, reg, log)
	r.preds = newPredictionBatcher(r, log)
	r.audit = newCacheAudit(log)
	r.tokcheck = newTokenizerCheck(cfg.TokenizerCheck, prompts.Lookup, state.Workers, reg, log.With("component", "tokenizer-check"))
	r.loras = newLoRADirectory(log.With("component", "lora"))
	r.agree = newTokenizerAgreement(cfg.NodeID, reg, log.With("component", "tokenizer-agreement"))
	state.OnChange(r.onChange)

	r.sync, err = eventbus.NewSyncer(bus.Conn(), eventbus.SyncConfig{Replica: cfg.NodeID, Registerer: reg, Logger: log}, r)
	if err != nil {
		return fmt.Errorf("replica sync: %w", err)
	}

	srv := api.New(api.Config{
		BusyStatus: cfg.BusyStatus, AdminToken: cfg.AdminToken, APIKeys: cfg.APIKeys, Prompts: prompts,
		Retries: cfg.Retries, AllowLoopbackWorkers: cfg.AllowLoopbackWorkers, MaxPriority: cfg.MaxPriority,
		MaxPriorityByKey: cfg.MaxPriorityByKey, MaxWorkers: cfg.MaxWorkers, MaxQueue: cfg.MaxQueue,
		WorkerHeaderTimeout: cfg.WorkerHeaderTimeout, WorkerIdleTimeout: cfg.WorkerIdleTimeout, ProtectStatus: cfg.ProtectStatus, MaxBodyBytes: cfg.MaxBodyBytes, Logger: log,
		Registry: reg, ClusterHandler: node.Handler(),
	}, r)
	ln, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("http listen: %w", err)
	}
	httpSrv := api.NewHTTPServer(srv.Handler(), api.ServerOptions{Logger: log})
	httpErr := make(chan error, 1)
	go func() { httpErr <- httpSrv.Serve(ln) }()
	log.Info("replica serving", "http", cfg.HTTPAddr, "raft", cfg.RaftAddr, "nats", bus.ClientURL(), "mode", cfg.Router.Mode)

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	node.WhileLeader(func(ctx context.Context) { r.lead(ctx) })
	go r.registerSelf(runCtx)
	go r.registerStatic(runCtx)
	go func() { _ = r.sync.Run(runCtx) }()
	go r.preds.run(runCtx)
	go r.health.run(runCtx, r)
	go r.tokcheck.run(runCtx)
	go r.loras.run(runCtx, state.Workers)
	if cfg.Insecure {
		go remindInsecure(runCtx, log)
	}
	go r.agree.run(runCtx, func() modelPrints { return printsOf(prompts.Describe(r.Models())) }, state.Nodes)

	if err := node.Form(runCtx); err != nil && runCtx.Err() == nil {
		return fmt.Errorf("forming the cluster: %w", err)
	}
	if cfg.BridgeConfig != "" {
		wait, err := startReplicaBridge(runCtx, cfg.BridgeConfig, bus.Conn(), cfg.AdvertiseHTTP, cfg.AdminToken,
			cfg.Router.BlockSize, reg, log.With("component", "bridge"))
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
	r.draining.Store(true)
	httpSrv.SetKeepAlivesEnabled(false)
	if cfg.DrainDelay > 0 {
		log.Info("draining: /ready is 503 (404 to the load balancer) while it moves away", "for", cfg.DrainDelay)
		time.Sleep(cfg.DrainDelay)
	}
	waitIdle(srv, cfg.DrainTimeout, log)
	stopCtx, stop := context.WithTimeout(context.Background(), 15*time.Second)
	defer stop()
	if err := httpSrv.Shutdown(stopCtx); err != nil {
		log.Warn("http shutdown: in-flight requests cut", "err", err)
	}
	log.Info("shutting down: leadership transfer first")
	cancel()
	if err := node.Shutdown(stopCtx); err != nil {
		log.Warn("raft shutdown", "err", err)
	}
	return nil
}

// waitIdle waits until srv serves no inference request, at most limit.
func waitIdle(srv *api.Server, limit time.Duration, log *slog.Logger) {
	deadline := time.Now().Add(limit)
	for n := srv.InFlight(); n > 0; n = srv.InFlight() {
		if time.Now().After(deadline) {
			log.Warn("drain timeout: closing with requests in flight", "in_flight", n, "after", limit)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// loadModels loads every --model-dir and the replica-wide --tokenizer /
// --chat-template the other models use. A broken directory stops the
// start, naming the file and the feature.
func loadModels(cfg serveConfig, log *slog.Logger) (*prompt.Set, error) {
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

func loadTokenizer(cfg serveConfig) (tokenize.Tokenizer, tokenize.Template, error) {
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

func openBus(cfg serveConfig, log *slog.Logger) (*eventbus.Bus, error) {
	host, port, err := splitHostPort(cfg.NATSAddr)
	if err != nil {
		return nil, fmt.Errorf("--nats-addr: %w", err)
	}
	sc := eventbus.ServerConfig{Name: cfg.NodeID, Host: host, Port: port, StoreDir: filepath.Join(cfg.DataDir, "jetstream"), Logger: log.With("component", "nats"),
		Security: eventbus.Security{Insecure: cfg.Insecure, TLS: cfg.TLS}}
	if !cfg.SingleNode && len(cfg.NATSRoutes) > 0 {
		ch, cp, err := splitHostPort(cfg.NATSClusterAddr)
		if err != nil {
			return nil, fmt.Errorf("--nats-cluster-addr: %w", err)
		}
		sc.ClusterName, sc.ClusterHost, sc.ClusterPort, sc.Routes = "kvrouter", ch, cp, cfg.NATSRoutes
	}
	bus, err := eventbus.OpenBus(eventbus.BusConfig{ExternalURL: cfg.NATSURL, Server: sc, ClientName: cfg.NodeID, Logger: log})
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

func clusterConfig(cfg serveConfig, state *fsm.FSM, reg prometheus.Registerer, log *slog.Logger) cluster.Config {
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
	c.Logger = log.With("component", "raft")
	c.Registry = reg
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
	return c
}

// registerSelf records this node's addresses in the replicated node
// registry (followers forward writes to the leader's HTTP address found
// there), retrying until it holds.
func (r *replica) registerSelf(ctx context.Context) {
	want := fsm.RegisterNode{NodeID: r.cfg.NodeID, RaftAddr: r.node.RaftAddr(), HTTPAddr: r.cfg.AdvertiseHTTP}
	cmd, err := fsm.EncodeRegisterNode(want)
	if err != nil {
		r.log.Error("node registration", "err", err)
		return
	}
	for ctx.Err() == nil {
		if rec, ok := r.fsm.Node(want.NodeID); ok && rec.HTTPAddr == want.HTTPAddr && rec.RaftAddr == want.RaftAddr {
			return
		}
		if err := r.propose(ctx, cmd); err != nil {
			r.log.Debug("node registration pending", "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// registerStatic registers the --workers list (no lease: they stay until
// deregistered) once the cluster takes writes.
func (r *replica) registerStatic(ctx context.Context) {
	for _, w := range r.cfg.StaticWorkers {
		cmd, err := fsm.EncodeRegisterWorker(fsm.RegisterWorker{ID: w.ID, DPRanks: 1, Address: w.URL, Model: r.cfg.Models[0],
			BlockSize: r.cfg.Router.BlockSize})
		if err != nil {
			r.log.Error("static worker", "worker", w.ID, "err", err)
			continue
		}
		for ctx.Err() == nil {
			if _, ok := r.fsm.Worker(w.ID); ok {
				break
			}
			if err := r.propose(ctx, cmd); err == nil {
				break
			}
			select {
			case <-ctx.Done():
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
}

// onChange follows replicated changes: routers re-read workers and knobs;
// stale workers are resynced by the leader.
func (r *replica) onChange(ch fsm.Change) {
	r.tokcheck.note(ch)
	switch ch.Kind {
	case fsm.ChangeWorkers, fsm.ChangeModelConfig, fsm.ChangeRestored:
		r.refresh()
	case fsm.ChangeStale:
		r.log.Warn("worker index out of step with the worker: resync", "worker", ch.Worker, "dp_rank", ch.DPRank, "reason", ch.Reason)
		if r.node.IsLeader() {
			go r.resync(ch.Worker, ch.DPRank, ch.Reason)
		}
	}
}

// resync drops the stale rank's blocks through Raft, then asks the worker
// to republish its full state. A worker that cannot (a real engine without
// our resync subject) rebuilds the index from its next events.
func (r *replica) resync(worker string, rank uint32, reason string) {
	// A stale mark replayed from the log at start-up, or one a Cleared event
	// in the same batch already ended, needs nothing.
	if _, still := r.fsm.Stale()[fsm.RankKey{Worker: worker, DPRank: rank}]; !still {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd, err := fsm.EncodeResyncWorker(fsm.ResyncWorker{Worker: worker, DPRank: rank})
	if err == nil {
		err = r.propose(ctx, cmd)
	}
	if err != nil {
		r.log.Error("resync: clearing the stale worker failed", "worker", worker, "err", err)
		return
	}
	reply, err := eventbus.RequestResync(ctx, r.bus.Conn(), eventbus.ResyncRequest{Worker: worker, DPRank: rank, Reason: reason})
	if err != nil || !reply.Accepted {
		r.log.Warn("resync: worker cannot republish; its blocks rebuild from new events", "worker", worker, "err", err, "reply", reply.Error)
		return
	}
	r.log.Info("resync: worker republishing its cache", "worker", worker, "next_event_id", reply.NextEventID)
}

// lead runs on the leader only: the KV event consumer and the clock tick.
func (r *replica) lead(ctx context.Context) {
	r.log.Info("leading: starting event ingest and ticks")
	go r.tick(ctx)
	replicas := 3
	if r.cfg.SingleNode || len(r.cfg.NATSRoutes) == 0 {
		replicas = 1
	}
	for ctx.Err() == nil {
		if err := r.consume(ctx, replicas); err != nil && ctx.Err() == nil {
			r.log.Warn("event ingest stopped; restarting", "err", err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
	r.log.Info("no longer leading: event ingest stopped")
}

func (r *replica) consume(ctx context.Context, replicas int) error {
	if _, err := eventbus.EnsureStream(ctx, r.bus.JetStream(), eventbus.StreamOptions{Replicas: replicas}); err != nil {
		return fmt.Errorf("kv event stream: %w", err)
	}
	cons, err := eventbus.NewConsumer(ctx, r.bus.JetStream(), eventbus.ConsumerConfig{
		Validator: r, Logger: r.log.With("component", "ingest"), Registerer: r.reg,
	})
	if err != nil {
		return fmt.Errorf("kv event consumer: %w", err)
	}
	return cons.Run(ctx, eventbus.ApplierFunc(r.applyEvents))
}

// CheckWorker validates an event's worker before anything reaches the log.
// worker is the rank-folded id (router.WorkerKey).
func (r *replica) CheckWorker(worker string, blockSize int) error {
	base, _, _ := strings.Cut(worker, "#")
	w, ok := r.fsm.Worker(base)
	if !ok {
		return fmt.Errorf("worker %q: %w", worker, router.ErrUnknownWorker)
	}
	if blockSize != 0 && blockSize != w.BlockSize && !(w.BlockSize == 0 && blockSize == r.fsm.BlockSize()) {
		return fmt.Errorf("worker %q: event block size %d, registered %d: %w", worker, blockSize, w.BlockSize, router.ErrBlockSizeMismatch)
	}
	return nil
}

// applyEvents commits a batch of KV events through Raft; the consumer acks
// the stream only when this returns nil.
func (r *replica) applyEvents(_ context.Context, events []eventbus.WireEvent) error {
	batch := make([]fsm.KVBatchEvent, len(events))
	for i := range events {
		ev := &events[i]
		batch[i] = fsm.KVBatchEvent{Worker: ev.Worker, DPRank: ev.DPRank, EventID: ev.EventID, Event: ev.KVEvent()}
	}
	cmd, err := fsm.EncodeKVBatch(batch)
	if err != nil {
		return fmt.Errorf("encode kv batch: %w", err)
	}
	f := r.node.ApplyLocal(cmd, 10*time.Second)
	if err := f.Error(); err != nil {
		return fmt.Errorf("commit kv batch: %w", err)
	}
	if res, ok := f.Response().(*fsm.ApplyResult); ok && res.Err != nil {
		return fmt.Errorf("apply kv batch: %w", res.Err)
	}
	return nil
}

// tick stamps the leader's clock into the log when something is due to
// expire (checked every second): predictions and worker leases expire
// deterministically on every replica, and an idle cluster's state stays
// still so digests compare equal.
func (r *replica) tick(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if next := r.fsm.NextExpiry(); next == 0 || next > now.UnixNano() {
				continue
			}
			cmd, err := fsm.EncodeTick(fsm.Tick{Now: now.UnixNano()})
			if err == nil {
				err = r.propose(ctx, cmd)
			}
			if err != nil && ctx.Err() == nil {
				r.log.Debug("tick", "err", err)
			}
		}
	}
}

// remindInsecure repeats, every minute, that this replica's bus runs
// without TLS or authentication: an insecure cluster must never look like a
// secure one in the logs.
func remindInsecure(ctx context.Context, log *slog.Logger) {
	t := time.NewTicker(time.Minute)
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
