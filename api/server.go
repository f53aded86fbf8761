// Package api is the replica's HTTP surface: the OpenAI-compatible routing
// proxy, Dynamo's /busy_threshold, health, readiness, metrics, cluster and
// debug endpoints. It owns no state of its own beyond metrics: routing state
// lives in the router package, replicated state behind the Replica interface.
package api

import (
	"bytes"
	"context"
	"crypto/subtle"
	"crypto/tls"
	"encoding/json"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrouter/kvrouter/api/capture"
	"github.com/kvrouter/kvrouter/api/decisionlog"
	"github.com/kvrouter/kvrouter/api/hitrate"
	"github.com/kvrouter/kvrouter/api/prompt"
	"github.com/kvrouter/kvrouter/api/tokenize"
)

// Config holds the HTTP layer's settings.
type Config struct {
	MaxBodyBytes int64    // request body limit (default 8 MiB → 413 above)
	BusyStatus   int      // status when every worker is busy: 529 (Dynamo) or 503
	AdminToken   string   // bearer token for admin endpoints; "" = open
	APIKeys      []string // accepted bearer keys for inference; empty = open
	// AdminOpenToLoopback names admin paths (of LoopbackExemptPaths only)
	// served without AdminToken to callers connecting from a loopback
	// address (kvrouter serve --admin-open-to-loopback; make run leaves
	// /busy_threshold open so the contract's runtime tuning works with a
	// plain curl). Each such request is logged (at most once a minute,
	// with a count) and counted in kvrouter_admin_loopback_exempt_total.
	AdminOpenToLoopback []string
	// ClusterAuth is the credential check of /cluster/raft_groups, the
	// cluster endpoint the API serves itself: the caller's member
	// certificate with TLS (cluster.Node.CheckRequest; docs/CONTRACTS.md,
	// "/cluster/* refuses callers without a peer credential"). It returns
	// the refusal's status and reason. nil: the admin token.
	ClusterAuth func(*http.Request) (status int, err error)
	// ClientCert, when set, must accept a request to the inference
	// endpoints (/v1/*, /tokenize, /detokenize) — the replica checks the
	// verified TLS client certificate there (--api-client-certs); with
	// APIKeys both are required.
	ClientCert func(*http.Request) error
	// WorkerAPIKey, when set, is sent to every worker as
	// "Authorization: Bearer <key>" (engines started with --api-key); the
	// client's own Authorization never reaches a worker.
	WorkerAPIKey string
	// WorkerAPIKeys are per-worker keys (worker id → key), sent instead
	// of WorkerAPIKey to the workers they name, every rank alike. They come
	// from a file on the replica's host (--worker-api-keys-file), never
	// from a registration: a key in a registration would sit in the Raft
	// log and snapshots of every replica.
	WorkerAPIKeys map[string]string
	// WorkerTLS checks the certificates of workers registered with
	// https:// URLs; nil: the system roots (Go's default).
	WorkerTLS    *tls.Config
	Tokenizer    tokenize.Tokenizer // must match the workers'
	ChatTemplate tokenize.Template
	// Prompts tokenizes requests per model; nil = every model uses
	// Tokenizer and ChatTemplate.
	Prompts        *prompt.Set
	ConnectTimeout time.Duration // dialing a worker
	Retries        int           // other workers tried when the worker could not have started the request (see retryable)
	QueueTimeout   time.Duration // longest wait in the admission queue
	// WorkerCooldown: after a failed connection a worker is tried last for
	// this long (default 5 s; negative = never).
	WorkerCooldown time.Duration
	Logger         *slog.Logger
	Registry       *prometheus.Registry // this replica's own registry
	ClusterHandler http.Handler         // mounted at /cluster/* for join/remove/apply (Raft layer)
	// ClusterGroups: data Raft groups whose endpoints ClusterHandler also
	// serves, under /cluster/g<g>/ (kvrouter serve --raft-groups; 0: none).
	ClusterGroups int

	// Bounds (DESIGN.md, "Bounds"). Zero values take the defaults named.

	// AllowLoopbackWorkers lets /workers/register take, and the proxy
	// dial, loopback, link-local and unspecified worker addresses. Off by
	// default: the proxy would otherwise reach the replica's own ports or a
	// cloud metadata endpoint for whoever can register a worker. Tests and
	// the local cluster (workers on 127.0.0.1) turn it on.
	AllowLoopbackWorkers bool
	// MaxWorkers caps registered workers (not ranks; default 1024) and
	// MaxModels the models (default 256): a registration beyond is
	// refused with 429. Renewals of registered workers always pass.
	MaxWorkers int
	MaxModels  int
	// MaxQueue caps the requests waiting in one model's admission queue
	// (default 1024); beyond, 429 at once.
	MaxQueue int
	// WorkerHeaderTimeout bounds the wait for a worker's answer headers
	// after the request was written (default 10 min: a non-streamed
	// answer's headers come with the whole generation; negative = none).
	// WorkerIdleTimeout bounds one read of the answer's body (default
	// 2 min; negative = none): a worker that sends headers and then
	// nothing is cut and its booking freed.
	WorkerHeaderTimeout time.Duration
	WorkerIdleTimeout   time.Duration
	// MaxPriority is the highest nvext.agent_hints.priority a client may
	// set (higher values are lowered to it); MaxPriorityByKey overrides it
	// per API key. 0 by default: clients may lower their priority, and
	// only keys given a cap may raise theirs.
	MaxPriority      int
	MaxPriorityByKey map[string]int
	// ProtectStatus puts /cluster/status and /metrics behind AdminToken
	// (off by default: dashboards and peers scrape them).
	ProtectStatus bool
	// MetricsCompat "dynamo" also exports Dynamo's frontend and router
	// metric names (metrics_dynamo.go); "" or "none": kvrouter_* only.
	MetricsCompat string
	// Decisions records every routing decision and its outcome
	// (decisions.go; GET /debug/decisions); nil: off.
	Decisions *decisionlog.Log
	// HitRateMaxBlocks bounds each model's block history behind the
	// "available" hit rate (hitrates.go; default 1 Mi blocks, ≈ 64 MiB per
	// model when full); negative turns the hit rates off.
	HitRateMaxBlocks int
	// Capture records answered requests as a replayable trace
	// (api/capture; kvbench sim --trace); nil: off.
	Capture *capture.Recorder
	// WarmUpShare > 0 sends a worker joining a model's candidate set that
	// share (up to 1) of the requests whose prefix is new or duplicated,
	// on purpose, until it is warm (warmup.go; --router-warmup-share);
	// 0: off.
	WarmUpShare float64
	// WarmUpShadow warms a joining worker by shadow prefills instead of
	// steering requests there (shadow.go; --router-warmup-shadow): copies
	// of the prefixes it lacks, max_tokens 1, answers thrown away, at most
	// ShadowInflight at once (0: 8). Wins over WarmUpShare.
	WarmUpShadow   bool
	ShadowInflight int
	// DrainShadow moves a drained worker's bound sessions by shadow
	// prefills (drainshadow.go; --router-drain-shadow): the replica keeps
	// each bound session's last body it served, at most
	// SessionBodiesMaxBytes in all (0: 64 MiB), and at a drain copies each
	// to the session's new worker (at most ShadowInflight at once), then
	// rebinds the session there. Needs session affinity; off by default.
	DrainShadow           bool
	SessionBodiesMaxBytes int64
	// Tenants, when set, turns tenant fairness and budgets on
	// (tenants.go, tenantgate.go): the replica shares it with replica
	// sync so its counters are the fleet's. nil: every request is one
	// tenant.
	Tenants *TenantLedger
	// ReservationTTL frees a selection API reservation nobody released
	// (selection.go; default 10 min).
	ReservationTTL time.Duration
}

// LogValue prints the configuration without its credentials, so a
// replica may log it.
func (c Config) LogValue() slog.Value {
	keys := make([]string, len(c.APIKeys))
	for i := range keys {
		keys[i] = redacted
	}
	admin := ""
	if c.AdminToken != "" {
		admin = redacted
	}
	return slog.GroupValue(
		slog.Int64("max_body_bytes", c.MaxBodyBytes), slog.Int("busy_status", c.BusyStatus),
		slog.String("admin_token", admin), slog.Any("api_keys", keys),
		slog.Duration("connect_timeout", c.ConnectTimeout), slog.Int("retries", c.Retries),
		slog.Duration("queue_timeout", c.QueueTimeout), slog.Duration("worker_cooldown", c.WorkerCooldown),
		slog.Bool("allow_loopback_workers", c.AllowLoopbackWorkers), slog.Int("max_workers", c.MaxWorkers),
		slog.Int("max_models", c.MaxModels), slog.Int("max_queue", c.MaxQueue),
		slog.Duration("worker_header_timeout", c.WorkerHeaderTimeout), slog.Duration("worker_idle_timeout", c.WorkerIdleTimeout),
		slog.Int("max_priority", c.MaxPriority), slog.Int("priority_caps_by_key", len(c.MaxPriorityByKey)),
		slog.Bool("protect_status", c.ProtectStatus), slog.Bool("client_certs", c.ClientCert != nil),
		slog.Any("admin_open_to_loopback", c.AdminOpenToLoopback))
}

// Server is one replica's HTTP server.
type Server struct {
	cfg     Config
	rep     Replica
	engine  *gin.Engine
	metrics *metrics
	client  *http.Client
	log     *slog.Logger
	gates   *gates
	cool    *cooldown
	// inflight counts inference requests being served, so a draining
	// replica can wait for them before it closes its listener.
	inflight atomic.Int64
	// reqSeq numbers this server's requests (the router's request ids).
	reqSeq atomic.Uint64
	// warnedNoTokenizer holds the models already logged as having no
	// tokenizer (one warning per model, the counter for every request).
	warnedNoTokenizer sync.Map
	// hits explains the hit rates (hitrates.go); nil: off.
	hits *hitrate.Tracker
	// exempt is Config.AdminOpenToLoopback (adminexempt.go); nil: none.
	exempt *loopbackExemption
	// warm is the warm-up of joining workers (warmup.go); nil: off.
	warm *warmUps
	// shadow is the shadow warm-up's copies (shadow.go); nil: off.
	shadow *shadows
	// drainCopies moves drained workers' sessions by copy
	// (drainshadow.go); nil: off.
	drainCopies *drainCopies
	// sessMetrics: session affinity's series (sessions.go); nil when the
	// replica keeps no bindings.
	sessMetrics *sessionMetrics
	// pinMetrics: prefix pinning's series (pins.go); nil when the replica
	// keeps no pins.
	pinMetrics *pinMetrics
	// tenants is Config.Tenants; tenantMetrics its series (nil: off).
	tenants       *TenantLedger
	tenantMetrics *tenantMetrics
	// resv are the selection API's reservations (selection.go).
	resv *reservations
	// relayBufs holds relay's read buffers (*[]byte of relayBufSize):
	// one per answer being relayed instead of one allocated per request.
	relayBufs sync.Pool
}

// relayBufSize is relay's read size: a whole non-streamed answer of
// ordinary size, many stream chunks.
const relayBufSize = 32 << 10

// Drainer is implemented by a replica that can be draining (SIGTERM
// received): /ready?draining=404 then answers 404 instead of 503, which
// HAProxy's `http-check disable-on-404` turns into "no new sessions, keep
// the open ones" rather than "down: cut every session".
type Drainer interface {
	Draining() bool
}

// WorkerMover is the optional part of a Replica whose block index is
// sharded across Raft groups (kvrouter serve --raft-groups): POST
// /workers/move places a worker in another data group and waits for the
// hand-over. A Replica without it answers 404 there.
type WorkerMover interface {
	MoveWorker(ctx context.Context, worker string, group int) (from int, err error)
}

// ShardAdmin is the rest of a sharded Replica's administration: the
// data-group count (GET and POST /cluster/raft_groups; it only grows, once
// every replica runs the new groups) and POST /workers/rebalance, which
// moves workers from the fullest groups to the emptiest.
type ShardAdmin interface {
	RaftGroups() (cluster, running int)
	SetRaftGroups(ctx context.Context, groups int) error
	Rebalance(ctx context.Context) ([]WorkerMove, error)
}

// WorkerMove is one move Rebalance made.
type WorkerMove struct {
	Worker string `json:"worker"`
	From   int    `json:"from"`
	To     int    `json:"to"`
}

// InFlight is the number of inference requests being served.
func (s *Server) InFlight() int64 { return s.inflight.Load() }

func (s *Server) countInFlight(c *gin.Context) {
	s.inflight.Add(1)
	defer s.inflight.Add(-1)
	c.Next()
}

// New builds the server; Handler serves it.
func New(cfg Config, rep Replica) *Server {
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = 8 << 20
	}
	if cfg.BusyStatus == 0 {
		cfg.BusyStatus = 529
	}
	if cfg.Tokenizer == nil {
		cfg.Tokenizer = tokenize.Builtin()
	}
	if cfg.Prompts == nil {
		cfg.Prompts = prompt.NewSet(nil, nil, cfg.Tokenizer, cfg.ChatTemplate, cfg.Tokenizer.Name())
	}
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = 2 * time.Second
	}
	if cfg.Retries < 0 {
		cfg.Retries = 0
	}
	if cfg.QueueTimeout <= 0 {
		cfg.QueueTimeout = 60 * time.Second
	}
	if cfg.WorkerCooldown == 0 {
		cfg.WorkerCooldown = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	if cfg.MaxWorkers <= 0 {
		cfg.MaxWorkers = defaultMaxWorkers
	}
	if cfg.MaxModels <= 0 {
		cfg.MaxModels = defaultMaxModels
	}
	if cfg.MaxQueue <= 0 {
		cfg.MaxQueue = defaultMaxQueue
	}
	if cfg.WorkerHeaderTimeout == 0 {
		cfg.WorkerHeaderTimeout = 10 * time.Minute
	}
	if cfg.WorkerIdleTimeout == 0 {
		cfg.WorkerIdleTimeout = 2 * time.Minute
	}
	if cfg.ReservationTTL <= 0 {
		cfg.ReservationTTL = 10 * time.Minute
	}
	s := &Server{
		cfg:     cfg,
		rep:     rep,
		metrics: newMetrics(cfg.Registry, rep, cfg.MetricsCompat),
		client:  newWorkerClient(cfg.ConnectTimeout, cfg.WorkerHeaderTimeout, cfg.AllowLoopbackWorkers, cfg.WorkerTLS),
		log:     cfg.Logger,
		gates:   newGates(),
		cool:    newCooldown(cfg.WorkerCooldown),
	}
	s.relayBufs.New = func() any { b := make([]byte, relayBufSize); return &b }
	s.hits = newHitTracker(cfg, rep)
	registerFleet(s) // fleet.go: kvrouter_worker_removal_cost, kvrouter_worker_drained
	s.warm = newWarmUps(cfg, s)
	s.shadow = newShadows(cfg)
	if sr, ok := rep.(SessionReplica); ok {
		s.sessMetrics = newSessionMetrics(cfg.Registry, sr)
	}
	if pr, ok := rep.(PinReplica); ok {
		s.pinMetrics = newPinMetrics(cfg.Registry, pr)
	}
	s.drainCopies = newDrainCopies(cfg, s)
	if cfg.Tenants != nil {
		s.tenants, s.tenantMetrics = cfg.Tenants, newTenantMetrics(cfg.Registry)
	}
	s.resv = newReservations(cfg.Registry)
	if cfg.AdminToken != "" {
		s.exempt = newLoopbackExemption(cfg.AdminOpenToLoopback, cfg.Logger, cfg.Registry)
	}
	s.engine = s.routes()
	return s
}

// Handler returns the HTTP handler.
func (s *Server) Handler() http.Handler { return s.engine }

func (s *Server) routes() *gin.Engine {
	gin.SetMode(gin.ReleaseMode)
	e := gin.New()
	e.Use(gin.Recovery(), s.limitBody)

	infer := e.Group("/v1", s.countInFlight, requestID, s.requireClientCert, s.requireKey)
	infer.POST("/chat/completions", s.chatCompletions)
	infer.POST("/completions", s.completions)
	infer.POST("/embeddings", s.embeddings)
	infer.POST("/score", s.score)
	infer.POST("/rerank", s.rerank)
	infer.POST("/responses", s.responses)
	infer.GET("/models", s.listModels)
	tok := e.Group("/", s.requireClientCert, s.requireKey)
	tok.POST("/tokenize", s.tokenize)
	tok.POST("/detokenize", s.detokenize)
	// Dynamo's standalone selection API (selection.go): inference callers
	// with their own proxy, so the inference endpoints' credentials.
	tok.POST("/select", s.selectWorker)
	tok.POST("/select_and_reserve", s.selectAndReserve)
	tok.POST("/reservations", s.reserve)
	tok.POST("/reservations/:id/prefill_complete", s.prefillComplete)
	tok.POST("/reservations/:id/output_block", s.outputBlock)
	tok.DELETE("/reservations/:id", s.release)

	e.GET("/health", func(c *gin.Context) { c.JSON(http.StatusOK, gin.H{"status": "ok", "node_id": s.rep.NodeID()}) })
	e.GET("/ready", s.ready)
	e.GET("/ui", s.statusPage) // the status page (ui.go); its reads carry their own protection
	e.GET("/ui/*file", s.statusPage)
	status := e.Group("/")
	if s.cfg.ProtectStatus {
		status.Use(s.requireAdmin)
	}
	status.GET("/metrics", gin.WrapH(promhttp.HandlerFor(s.cfg.Registry, promhttp.HandlerOpts{Registry: s.cfg.Registry})))
	// ?digest=0 skips the state digest (a pass over the whole index);
	// ?view=cursors answers only the workers' event cursors (cursorstatus.go),
	// what kvbench ingest polls every few milliseconds.
	status.GET("/cluster/status", s.clusterStatus)

	admin := e.Group("/", s.requireAdmin)
	admin.GET("/busy_threshold", s.getBusyThreshold)
	admin.POST("/busy_threshold", s.postBusyThreshold)
	admin.POST("/debug/route", s.debugRoute)
	admin.GET("/debug/decisions", s.debugDecisions)
	admin.GET("/workers", s.listWorkers)
	admin.POST("/workers/register", s.registerWorker)
	admin.POST("/workers/deregister", s.deregisterWorker)
	admin.POST("/workers/move", s.moveWorker)
	admin.POST("/workers/rebalance", s.rebalanceWorkers)
	admin.POST("/workers/drain", s.drainWorker)     // fleet.go
	admin.POST("/workers/undrain", s.undrainWorker) // fleet.go
	admin.GET("/fleet/plan", s.getFleetPlan)        // fleet.go
	admin.GET("/sessions/*id", s.getSession)
	admin.GET("/pins", s.getPins)       // pins.go
	admin.DELETE("/pins", s.deletePins) // pins.go
	// Under /cluster/, so a member's credential, not the operator's token
	// (it writes the Raft log: fsm.SetGroups).
	peer := e.Group("/", s.requirePeer)
	peer.GET("/cluster/raft_groups", s.getRaftGroups)
	peer.POST("/cluster/raft_groups", s.setRaftGroups)
	if s.cfg.ClusterHandler != nil {
		h := gin.WrapH(s.cfg.ClusterHandler)
		for g := 0; g <= s.cfg.ClusterGroups; g++ {
			prefix := "/cluster"
			if g > 0 {
				prefix = "/cluster/g" + strconv.Itoa(g)
			}
			for _, p := range []string{"/join", "/remove", "/apply"} {
				admin.POST(prefix+p, h)
			}
			// Followers read the leader's commit index here to judge readiness.
			admin.GET(prefix+"/commit", h)
		}
	}
	// Unknown paths (and methods: 404 too, as documented) answer in
	// OpenAI's error shape, as every client of this API parses it (gin's
	// default is a plain-text 404).
	e.NoRoute(func(c *gin.Context) {
		openAIError(c, http.StatusNotFound, "not_found_error", "no route for "+c.Request.Method+" "+c.Request.URL.Path)
	})
	return e
}

// limitBody caps request bodies; reading past the cap fails and the handler
// answers 413.
func (s *Server) limitBody(c *gin.Context) {
	if c.Request.ContentLength > s.cfg.MaxBodyBytes {
		openAIError(c, http.StatusRequestEntityTooLarge, "invalid_request_error", "request body too large")
		return
	}
	c.Request.Body = http.MaxBytesReader(c.Writer, c.Request.Body, s.cfg.MaxBodyBytes)
	c.Next()
}

func bearer(c *gin.Context) string {
	h := c.GetHeader("Authorization")
	if t, ok := strings.CutPrefix(h, "Bearer "); ok {
		return strings.TrimSpace(t)
	}
	return ""
}

func (s *Server) requireKey(c *gin.Context) {
	if len(s.cfg.APIKeys) == 0 {
		return
	}
	got := bearer(c)
	for _, k := range s.cfg.APIKeys {
		if subtle.ConstantTimeCompare([]byte(got), []byte(k)) == 1 {
			return
		}
	}
	openAIError(c, http.StatusUnauthorized, "authentication_error", "missing or invalid API key")
}

// requireClientCert applies Config.ClientCert to the inference endpoints:
// a request without the certificate it asks for is refused before its body
// is read.
func (s *Server) requireClientCert(c *gin.Context) {
	if s.cfg.ClientCert == nil {
		return
	}
	if err := s.cfg.ClientCert(c.Request); err != nil {
		openAIError(c, http.StatusUnauthorized, "authentication_error", "client certificate required: "+err.Error())
	}
}

func (s *Server) requireAdmin(c *gin.Context) {
	if s.cfg.AdminToken == "" {
		return
	}
	if subtle.ConstantTimeCompare([]byte(bearer(c)), []byte(s.cfg.AdminToken)) == 1 {
		return
	}
	if s.loopbackExempt(c) {
		return
	}
	c.AbortWithStatusJSON(http.StatusUnauthorized, gin.H{"error": "admin endpoints need the bearer token"})
}

// requirePeer applies Config.ClusterAuth (the admin token without it).
func (s *Server) requirePeer(c *gin.Context) {
	if s.cfg.ClusterAuth == nil {
		s.requireAdmin(c)
		return
	}
	if status, err := s.cfg.ClusterAuth(c.Request); err != nil {
		c.AbortWithStatusJSON(status, gin.H{"error": err.Error()})
	}
}

// clusterStatus answers the replica's status document with credentials
// removed (redactDoc): it may name the bus URL, whose userinfo is a
// password. The round trip through JSON reaches values inside structs.
func (s *Server) clusterStatus(c *gin.Context) {
	if c.Query("view") == "cursors" && s.cursorStatus(c) {
		return
	}
	raw, err := json.Marshal(s.rep.Status(c.Query("digest") != "0"))
	if err != nil {
		c.JSON(http.StatusInternalServerError, gin.H{"error": s.redact("encoding the status: " + err.Error())})
		return
	}
	var doc any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber() // exact 64-bit indexes and terms
	if err := dec.Decode(&doc); err != nil {
		c.JSON(http.StatusInternalServerError, gin.H{"error": "decoding the status: " + err.Error()})
		return
	}
	s.addHitRates(doc)
	s.addFleetPlan(doc)
	c.JSON(http.StatusOK, s.redactDoc(doc))
}

func (s *Server) ready(c *gin.Context) {
	ok, reason := s.rep.Ready()
	if !ok {
		status := http.StatusServiceUnavailable
		if d, isD := s.rep.(Drainer); isD && d.Draining() && c.Query("draining") == "404" {
			status = http.StatusNotFound
		}
		c.JSON(status, gin.H{"ready": false, "reason": s.redact(reason), "node_id": s.rep.NodeID()})
		return
	}
	c.JSON(http.StatusOK, gin.H{"ready": true, "node_id": s.rep.NodeID()})
}
