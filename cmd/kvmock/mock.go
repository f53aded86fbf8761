package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/engine"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/eventbus/registrar"
)

// Mock is one simulated worker: the engine in real time behind an
// OpenAI-compatible HTTP API, its KV events published to the cluster.
type Mock struct {
	cfg config
	log *slog.Logger
	tok tokenize.Tokenizer // spells the generated output (builtin words)
	// prompt turns request bodies into prompt ids: the --model-dir files,
	// or the builtin tokenizer with --chat-template.
	prompt  *prompt.Model
	engCfg  engine.Config // with the engine's defaults filled in
	profile string        // timing profile name
	drv     *driver
	q       *eventQueue // nil: no bus
	connect connectFunc // nil: no bus
	// reg keeps the worker registered (nil: no --register); Serve builds
	// it from regCfg once it knows the advertised URL.
	reg     *registrar.Registrar
	regCfg  registrar.Config
	started time.Time
	// firstEventID numbers the first KV event of this run.
	firstEventID uint64

	advertise string // set by Serve before the HTTP server starts

	pubMu sync.Mutex
	pub   Publisher // set once connected

	reqSeq atomic.Uint64
	ctr    counters
	fwd    forwardedHeaders // identity headers a router forwarded (apikey.go)

	// ranks are the other data-parallel ranks behind this (rank 0's) URL
	// (--dp-ranks; dp.go): ranks[r-1] is rank r.
	ranks   []*Mock
	rankCtr rankCounters

	// Disaggregation: the prefill side's transfers and link, the decode
	// side's pull client (its own transport: no process-global state).
	transfers  *transferStore
	link       *kvLink
	pullClient *http.Client
	pullCtr    pullCounters
}

// counters are the HTTP side's totals.
type counters struct {
	chat, completions, streams             atomic.Uint64
	completed, cancelled                   atomic.Uint64
	badRequests, serverErrors              atomic.Uint64
	unauthorized                           atomic.Uint64 // --api-key refusals (apikey.go)
	promptTokens, cachedTokens, outputToks atomic.Uint64
	inflight                               atomic.Int64
}

// newMock builds a worker. connect nil means no KV events are published.
func newMock(cfg config, log *slog.Logger, connect connectFunc) (*Mock, error) {
	ecfg := cfg.engineConfig()
	var host *hostTier
	if cfg.HostTierBlocks > 0 {
		host = newHostTier(cfg.HostTierBlocks, cfg.BlockSize)
		ecfg.LowerTier = host.holds
	}
	eng, err := engine.New(cfg.ID, ecfg)
	if err != nil {
		return nil, err
	}
	pm, err := loadPrompt(cfg)
	if err != nil {
		return nil, err
	}
	m := &Mock{
		cfg:     cfg,
		log:     log,
		tok:     tokenize.Builtin(),
		prompt:  pm,
		engCfg:  eng.Config(),
		profile: eng.Profile().Name,
		connect: connect,
		started: time.Now(),

		transfers:  newTransferStore(cfg.KVTransferTTL),
		link:       newKVLink(cfg.LinkMBps, cfg.LinkMaxTransfers, eng.Config().Speedup),
		pullClient: &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()},
	}
	m.firstEventID = cfg.EventIDStart
	if m.firstEventID == 0 {
		m.firstEventID = uint64(m.started.UnixMicro())
	}
	if connect != nil {
		m.q = newEventQueue(cfg.EventQueue, log.With("component", "events"))
	}
	m.drv = newDriver(eng, m.q, log.With("component", "engine"))
	m.drv.host = host
	if cfg.DPRanks > 1 && cfg.DPRank == 0 {
		for r := 1; r < cfg.DPRanks; r++ {
			rc := cfg
			rc.DPRank, rc.Register = uint32(r), nil // rank 0 registers the worker with all its ranks
			sub, err := newMock(rc, log.With("dp_rank", r), connect)
			if err != nil {
				return nil, fmt.Errorf("dp rank %d: %w", r, err)
			}
			m.ranks = append(m.ranks, sub)
		}
	}
	if len(cfg.Register) > 0 {
		m.regCfg = registrationConfig(cfg, m.engCfg, log)
		if m.regCfg.Client, err = cfg.registerClient(); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// loadPrompt builds what tokenizes prompts: the model directory's files
// (prompt.Load, the router's own code, so both compute the same ids from
// the same files), with its chat template replaced by --chat-template-file;
// without a directory, the builtin tokenizer with --chat-template.
func loadPrompt(cfg config) (*prompt.Model, error) {
	if cfg.ModelDir == "" {
		return prompt.Legacy(cfg.Model, tokenize.Builtin(), cfg.ChatTemplate, "builtin"), nil
	}
	pm, err := prompt.Load(cfg.Model, cfg.ModelDir)
	if err != nil {
		return nil, fmt.Errorf("--model-dir: %w", err)
	}
	if cfg.ChatTemplateFile == "" {
		return pm, nil
	}
	src, err := os.ReadFile(cfg.ChatTemplateFile)
	if err != nil {
		return nil, fmt.Errorf("--chat-template-file: %w", err)
	}
	if pm, err = pm.WithChatTemplate(string(src)); err != nil {
		return nil, fmt.Errorf("--chat-template-file %s: %w", cfg.ChatTemplateFile, err)
	}
	return pm, nil
}

// chatTemplateName says which chat template renders prompts (for the log).
func (m *Mock) chatTemplateName() string {
	switch {
	case m.cfg.ChatTemplateFile != "":
		return m.cfg.ChatTemplateFile
	case m.cfg.ModelDir != "":
		return "the model directory's"
	}
	return m.cfg.ChatTemplate.String()
}

// advertiseURL is the configured URL, or http:// plus the bound address
// (an unspecified host becomes 127.0.0.1).
func advertiseURL(configured string, addr net.Addr) string {
	if configured != "" {
		return configured
	}
	host, port, err := net.SplitHostPort(addr.String())
	if err != nil {
		return "http://" + addr.String()
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return "http://" + net.JoinHostPort(host, port)
}

// Run listens on the configured address and serves until ctx ends.
func (m *Mock) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", m.cfg.Addr)
	if err != nil {
		return err
	}
	return m.Serve(ctx, ln)
}

// Serve runs the worker on ln until ctx ends, then shuts down gracefully:
// deregister, let requests finish (up to the shutdown timeout), stop the
// engine, publish what is queued, flush the publisher, close.
func (m *Mock) Serve(ctx context.Context, ln net.Listener) error {
	m.advertise = advertiseURL(m.cfg.AdvertiseURL, ln.Addr())

	drvCtx, stopDrv := context.WithCancel(context.Background())
	defer stopDrv()
	go m.drv.run(drvCtx)
	// The link outlives the HTTP server: pulls in flight finish during a
	// graceful shutdown.
	linkCtx, stopLink := context.WithCancel(context.Background())
	defer stopLink()
	go m.link.run(linkCtx)
	defer m.pullClient.CloseIdleConnections()
	// The cache starts empty: say so first (the first event is a cleared one).
	if err := m.drv.call(ctx, func() { m.drv.snapshot("startup") }); err != nil {
		return err
	}

	var ready <-chan struct{} // publishing waits for the first registration
	regCtx, stopReg := context.WithCancel(context.Background())
	regDone := make(chan struct{})
	if len(m.cfg.Register) > 0 {
		rc := m.regCfg
		rc.Spec.URL = m.advertise
		m.reg = registrar.New(rc)
		ready = m.reg.Registered()
		go func() { defer close(regDone); m.reg.Run(regCtx, nil) }()
	} else {
		open := make(chan struct{})
		close(open)
		ready = open
		close(regDone)
		m.log.Warn("no --register: this worker does not announce itself; register it with the routers yourself")
	}

	busCtx, stopBus := context.WithCancel(context.Background())
	busDone := make(chan struct{})
	if m.q != nil {
		go func() { defer close(busDone); m.runBus(busCtx, ready) }()
	} else {
		close(busDone)
		m.log.Warn("!!! no --nats: KV events are NOT published; a router in kv mode will never see this worker's cache !!!")
	}

	stopRanks := m.startRanks(ready)
	srv := &http.Server{Handler: m.guard(m.front()), ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(m.log.Handler(), slog.LevelWarn)}
	srvErr := make(chan error, 1)
	go func() { srvErr <- srv.Serve(ln) }()
	m.log.Info("kvmock serving", "id", m.cfg.ID, "addr", ln.Addr().String(), "url", m.advertise, "model", m.cfg.Model,
		"block_size", m.engCfg.BlockSize, "kv_blocks", m.engCfg.CapacityBlocks, "max_batched_tokens", m.engCfg.MaxBatchedTokens,
		"max_running", m.engCfg.MaxRunning, "profile", m.profile, "speedup", m.engCfg.Speedup,

		"tokenizer", m.prompt.Tokenizer().Name(), "model_dir", m.cfg.ModelDir, "chat_template", m.chatTemplateName(), "fingerprint", m.prompt.Fingerprint(),
		"nats", m.cfg.NATS, "register", m.cfg.Register, "first_event_id", m.firstEventID,
		"role", m.cfg.Role, "link_mbps", m.cfg.LinkMBps, "link_max_transfers", m.cfg.LinkMaxTransfers, "kv_bytes_per_token", m.cfg.KVBytesPerToken)

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-srvErr:
		m.log.Error("HTTP server failed", "err", runErr)
	}

	m.log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), m.cfg.ShutdownTimeout)
	defer cancel()
	stopReg()
	<-regDone
	if m.reg != nil {
		if err := m.reg.Deregister(sctx); err != nil {
			m.log.Warn("deregistration failed", "err", err)
		} else {
			m.log.Info("deregistered")
		}
	}
	if err := srv.Shutdown(sctx); err != nil {
		m.log.Warn("requests still running at the shutdown timeout; cancelling them", "err", err)
		_ = srv.Close()
	}
	stopRanks(sctx)
	stopDrv()
	<-m.drv.done
	stopLink()
	<-m.link.done
	if pub := m.publisher(); pub != nil && isClosed(ready) {
		if err := m.q.waitEmpty(sctx); err != nil {
			m.log.Error("KV events not published before the shutdown timeout", "queued", m.q.len())
		}
		if err := pub.Flush(sctx); err != nil {
			m.log.Error("KV events not acknowledged before the shutdown timeout", "err", err, "in_flight", pub.Stats().InFlight)
		}
	} else if m.q != nil && m.q.len() > 0 {
		m.log.Error("KV events never published (no NATS connection or never registered)", "queued", m.q.len())
	}
	stopBus()
	<-busDone
	m.log.Info("stopped")
	if errors.Is(runErr, http.ErrServerClosed) {
		runErr = nil
	}
	return runErr
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func (m *Mock) publisher() Publisher {
	m.pubMu.Lock()
	defer m.pubMu.Unlock()
	return m.pub
}

// runBus connects to NATS (retrying until it can), waits for the first
// registration (events of an unregistered worker would be rejected), then
// publishes the event queue until ctx ends; it closes the publisher and
// the connection on the way out.
func (m *Mock) runBus(ctx context.Context, ready <-chan struct{}) {
	hooks := busHooks{firstEventID: m.firstEventID, onError: m.onPublishError, onAck: m.onPublishAck, resync: m.resync,
		eventsPerMsg: m.cfg.EventsPerMsg, compactHashes: m.cfg.CompactHashes}
	backoff := 250 * time.Millisecond
	var (
		pub     Publisher
		closeFn func()
	)
	for attempt := 1; ; attempt++ {
		var err error
		pub, closeFn, err = m.connect(ctx, m.cfg.ID, m.cfg.DPRank, hooks)
		if err == nil {
			break
		}
		if attempt == 1 || attempt%10 == 0 {
			m.log.Error("cannot reach NATS; KV events are buffered until it is up", "attempt", attempt, "queued", m.q.len(), "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff/2 + rand.N(backoff/2+1)):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
	m.pubMu.Lock()
	m.pub = pub
	m.pubMu.Unlock()
	defer func() {
		pub.Close()
		if closeFn != nil {
			closeFn()
		}
	}()
	select {
	case <-ready:
	case <-ctx.Done():
		return
	}
	m.q.pump(ctx, pub, func(error) {
		go m.drv.send(func() { m.drv.snapshot("event rejected") })
	})
}

// onPublishError: the publisher gave up on an event it had numbered. The
// index will see a gap in this worker's ids; republish the full state so it
// can recover without waiting for a resync request.
func (m *Mock) onPublishError(eventID uint64, err error) {
	if errors.Is(err, eventbus.ErrPublisherClosed) {
		m.q.unconfirmed.Add(1)
		return
	}
	m.q.lost.Add(1)
	m.log.Error("KV event lost by the publisher; republishing the full state", "event_id", eventID, "err", err)
	go m.drv.send(func() { m.drv.snapshot(fmt.Sprintf("event %d lost", eventID)) })
}

// onPublishAck watches for duplicate acks. After a lost ack the
// publisher's re-send is acknowledged as a duplicate, which is harmless.
// But the stream deduplicates by worker:rank:event_id for a window (2 min
// by default): a run that reuses an earlier run's ids (a fixed
// --event-id-start) inside it has its events dropped. Say so.
func (m *Mock) onPublishAck(a eventbus.PublishAck) {
	if !a.Duplicate {
		return
	}
	if n := m.q.duplicates.Add(1); n <= 10 || n%1000 == 0 {
		m.log.Warn("the stream already had this event id: a re-send after a lost ack (harmless), or an earlier run of this worker id "+
			"used the same ids within the stream's dedupe window (then this event was dropped: do not fix --event-id-start)",
			"event_id", a.EventID, "duplicates", n)
	}
}

// resync answers a resync request: queue a cleared event and the full
// cache state behind the events already queued. NextEventID is read first,
// so the cleared event's id is at least that.
func (m *Mock) resync(req eventbus.ResyncRequest, pub Publisher) eventbus.ResyncReply {
	if req.DPRank != m.cfg.DPRank {
		// Rank 0 serves the worker's resync subject for every rank.
		r := m.rank(int(req.DPRank))
		if m.cfg.DPRank != 0 || r == nil || r == m {
			return eventbus.ResyncReply{Error: fmt.Sprintf("kvmock %s has dp ranks 0-%d, not %d", m.cfg.ID, max(m.cfg.DPRanks, 1)-1, req.DPRank)}
		}
		rpub := r.publisher()
		if rpub == nil {
			return eventbus.ResyncReply{Error: fmt.Sprintf("dp rank %d is not connected to the bus yet", req.DPRank)}
		}
		return r.resync(req, rpub)
	}
	next := pub.NextEventID()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	reason := "resync requested"
	if req.Reason != "" {
		reason += ": " + req.Reason
	}
	if err := m.drv.call(ctx, func() { m.drv.snapshot(reason) }); err != nil {
		return eventbus.ResyncReply{Error: err.Error()}
	}
	return eventbus.ResyncReply{Accepted: true, NextEventID: next}
}
