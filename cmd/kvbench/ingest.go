package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/live"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/progress"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/pki"
	"github.com/kvrouter/kvrouter/internal/splitmix"
)

// defaultEventsPerMsg is --events-per-msg's default (BENCHMARKS.md, issue
// 31 item 3: the stream's cost is per message).
const defaultEventsPerMsg = 64

// ingestOptions are kvbench ingest's validated flags.
type ingestOptions struct {
	Target         string
	Replicas       []string // explicit --replicas (the target added first)
	NATS           string
	Duration       time.Duration
	Workers        int
	BlocksPerEvent int
	BlockSize      int
	WorkerBlocks   int
	Window         int
	EventsPerMsg   int
	CompactHashes  bool
	MaxUnapplied   int
	Poll           time.Duration
	SampleEvery    int
	DrainTimeout   time.Duration
	Model          string
	AdminToken     string
	AdminTokenFrom string // where AdminToken came from (secrets.go), "" for none
	NATSCA         string // CA of a TLS bus (tls://)
	NATSTokenFile  string // the replicas' bus token, for a bus that requires authentication
	KeepWorkers    bool
	JSON           string
	Progress       progress.Flags
}

func parseIngestFlags(args []string, output io.Writer) (*ingestOptions, error) {
	o := &ingestOptions{}
	fs := flag.NewFlagSet("kvbench ingest", flag.ContinueOnError)
	fs.SetOutput(output)
	var replicas string
	fs.StringVar(&o.Target, "target", "", "HTTP base URL of one replica of the cluster (required), e.g. http://127.0.0.1:8001")
	fs.StringVar(&replicas, "replicas", "", "comma list of every replica's HTTP base URL (default: discovered from the target's /cluster/status)")
	fs.StringVar(&o.NATS, "nats", "", "NATS URL(s) to publish to, comma separated; worker i uses entry i mod n (default: the target's nats_url)")
	fs.StringVar(&o.NATSCA, "nats-ca", os.Getenv("KVBENCH_NATS_CA"), "PEM CA of a TLS event bus (default: "+defaultRunCA+" when it exists, as `make run` writes it)")
	fs.StringVar(&o.NATSTokenFile, "nats-token-file", os.Getenv("KVBENCH_NATS_TOKEN_FILE"), "file holding the replicas' bus token (default: "+defaultRunToken+" when it exists)")
	fs.DurationVar(&o.Duration, "duration", 10*time.Second, "how long to publish")
	fs.IntVar(&o.Workers, "workers", 8, "synthetic workers (one publisher and one NATS connection each)")
	// vLLM publishes a scheduled prefill chunk as one BlockStored event carrying all its
	// blocks (512 tokens = 32 blocks of 16); 4-block events are a stress setting.
	fs.IntVar(&o.BlocksPerEvent, "blocks-per-event", 32, "stored blocks per KV event (vLLM: one event per prefill chunk)")
	fs.IntVar(&o.BlockSize, "block-size", 16, "tokens per block (must equal the cluster's)")
	fs.IntVar(&o.WorkerBlocks, "worker-blocks", 2048, "KV capacity of a synthetic worker in blocks: past it, the worker evicts its oldest blocks (one removed event for half of them), as an engine does, so the index stays bounded (0: never evict; the index grows for the whole run)")
	fs.IntVar(&o.Window, "window", 512, "events in flight per publisher (sent, not yet acknowledged by the stream)")
	fs.BoolVar(&o.CompactHashes, "compact-hashes", true, "publish the events' hashes in the compact form (eventbus.WithCompactHashes: 8 bytes a block where a map of two keyed integers takes 23; about half the bytes of a stored event for the stream to write, replicate and deliver); false: the map form, which replicas of builds before the compact form also read")
	fs.IntVar(&o.EventsPerMsg, "events-per-msg", defaultEventsPerMsg, "KV events per NATS message: the publishers coalesce consecutive events into batch messages of up to this many, each sent at the latest 1ms after its first event (1: one event per message, the single-event form; batches need replicas that know the batch form)")
	fs.IntVar(&o.MaxUnapplied, "max-unapplied", 512, "events published but not yet visible on every replica, over all workers, before publishers wait (0: no limit; the stream may then build a backlog)")
	fs.DurationVar(&o.Poll, "poll", 10*time.Millisecond, "interval of the /cluster/status?view=cursors polls of every replica (resolution of visible_ms)")
	fs.IntVar(&o.SampleEvery, "sample-every", 50, "measure visibility of every Nth event of each worker")
	fs.DurationVar(&o.DrainTimeout, "drain-timeout", 60*time.Second, "after publishing, how long to wait for acknowledgements and visibility")
	fs.StringVar(&o.Model, "model", "", "model the synthetic workers register under (default: the cluster's first model)")
	adminToken := registerSecret(fs, "admin-token", "KVROUTER_ADMIN_TOKEN", defaultRunAdminToken, "bearer token of the admin endpoints, to register the synthetic workers")
	fs.BoolVar(&o.KeepWorkers, "keep-workers", false, "leave the synthetic workers registered (default: deregister them at the end)")
	fs.StringVar(&o.JSON, "json", "", "write the JSON report to this file")
	o.Progress.Register(fs)
	if err := cli.Parse(fs, args); err != nil {
		return nil, err
	}
	if err := o.Progress.Check(); err != nil {
		return nil, cli.Usagef("%v", err)
	}
	if o.Target == "" {
		return nil, cli.Usagef("--target is required (a replica's HTTP URL, e.g. http://127.0.0.1:8001)")
	}
	var err error
	if o.AdminToken, o.AdminTokenFrom, err = adminToken.resolve(); err != nil {
		return nil, cli.Usagef("%v", err)
	}
	if o.Target, err = live.ParseLocalURL(o.Target); err != nil {
		return nil, cli.Usagef("--target: %v", err)
	}
	if replicas != "" {
		o.Replicas = []string{o.Target}
		for _, r := range strings.Split(replicas, ",") {
			u, err := live.ParseLocalURL(strings.TrimSpace(r))
			if err != nil {
				return nil, cli.Usagef("--replicas: %v", err)
			}
			if !slices.Contains(o.Replicas, u) {
				o.Replicas = append(o.Replicas, u)
			}
		}
	}
	if o.NATS != "" {
		for _, u := range strings.Split(o.NATS, ",") {
			if err := checkNATSURL(strings.TrimSpace(u)); err != nil {
				return nil, cli.Usagef("--nats: %v", err)
			}
		}
	}
	switch {
	case o.Duration <= 0:
		return nil, cli.Usagef("--duration %v: must be positive", o.Duration)
	case o.Duration > time.Hour:
		return nil, cli.Usagef("--duration %v: at most an hour", o.Duration)
	case o.Workers < 1 || o.Workers > 1024:
		return nil, cli.Usagef("--workers %d: want 1..1024", o.Workers)
	case o.BlocksPerEvent < 1 || o.BlocksPerEvent > eventbus.DefaultMaxBlocks:
		return nil, cli.Usagef("--blocks-per-event %d: want 1..%d", o.BlocksPerEvent, eventbus.DefaultMaxBlocks)
	case o.BlockSize < 1 || o.BlockSize > eventbus.MaxBlockSize:
		return nil, cli.Usagef("--block-size %d: want 1..%d", o.BlockSize, eventbus.MaxBlockSize)
	case o.WorkerBlocks < 0:
		return nil, cli.Usagef("--worker-blocks %d: must not be negative", o.WorkerBlocks)
	case o.WorkerBlocks > 0 && o.WorkerBlocks < 2*o.BlocksPerEvent:
		return nil, cli.Usagef("--worker-blocks %d: must hold at least two events (2 × --blocks-per-event %d), or be 0", o.WorkerBlocks, o.BlocksPerEvent)
	case o.Window < 1 || o.Window > 1<<16:
		return nil, cli.Usagef("--window %d: want 1..65536", o.Window)
	case o.EventsPerMsg < 1 || o.EventsPerMsg > eventbus.MaxBatchEvents:
		return nil, cli.Usagef("--events-per-msg %d: want 1..%d", o.EventsPerMsg, eventbus.MaxBatchEvents)
	case o.MaxUnapplied < 0:
		return nil, cli.Usagef("--max-unapplied %d: must not be negative", o.MaxUnapplied)
	case o.Poll < time.Millisecond || o.Poll > 10*time.Second:
		return nil, cli.Usagef("--poll %v: want 1ms..10s", o.Poll)
	case o.SampleEvery < 1:
		return nil, cli.Usagef("--sample-every %d: must be positive", o.SampleEvery)
	case o.DrainTimeout <= 0:
		return nil, cli.Usagef("--drain-timeout %v: must be positive", o.DrainTimeout)
	}
	return o, nil
}

// Where `make run` (deploy/local/run.sh, default KVROUTER_RUN_DIR) writes
// the cluster CA and the replica token: kvbench drives local clusters, so
// it finds them there when run from the project root.
const (
	defaultRunCA    = "tmp/run/certs/ca.pem"
	defaultRunToken = "tmp/run/secrets/replica-token"
)

// natsOptions are the credentials kvbench connects to the bus with: the
// cluster CA to trust a TLS bus and the replica token to authenticate
// (a secure bus admits nobody anonymous), from flags, their environment
// variables, or make run's files.
func (o *ingestOptions) natsOptions() ([]eventbus.ConnectOption, error) {
	ca, tokFile := o.NATSCA, o.NATSTokenFile
	if ca == "" && fileExists(defaultRunCA) {
		ca = defaultRunCA
	}
	if tokFile == "" && fileExists(defaultRunToken) {
		tokFile = defaultRunToken
	}
	var opts []eventbus.ConnectOption
	if ca != "" {
		pool, err := pki.LoadPool(ca)
		if err != nil {
			return nil, fmt.Errorf("--nats-ca: %w", err)
		}
		opts = append(opts, eventbus.WithTLSConfig(pki.TrustOnlyTLS(pool, pki.AllowRoles(pki.RoleNode))))
	}
	if tokFile != "" {
		tok, err := pki.ReadSecretFile(tokFile)
		if err != nil {
			return nil, fmt.Errorf("--nats-token-file: %w", err)
		}
		opts = append(opts, eventbus.WithToken(tok))
	}
	return opts, nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func checkNATSURL(u string) error {
	rest, ok := strings.CutPrefix(u, "nats://")
	if !ok {
		rest, ok = strings.CutPrefix(u, "tls://")
	}
	if !ok {
		return fmt.Errorf("%q is not a nats:// or tls:// URL", u)
	}
	host := rest
	if i := strings.LastIndexByte(rest, ':'); i >= 0 {
		host = rest[:i]
	}
	host = strings.Trim(host, "[]")
	if !live.IsLocalHost(host) {
		return fmt.Errorf("%q is not a localhost URL (kvbench drives local clusters only)", u)
	}
	return nil
}

// ingestReport is the JSON document: the contract's fields first
// (docs/CONTRACTS.md), then extras.
type ingestReport struct {
	EventsPerS float64         `json:"events_per_s"`
	VisibleMs  stats.Quantiles `json:"visible_ms"`
	Published  uint64          `json:"published"`
	Acked      uint64          `json:"acked"`
	Lost       uint64          `json:"lost"`

	// Extras.
	Unit              string            `json:"unit"`
	Config            ingestConfig      `json:"config"`
	CommittedBlocks   int               `json:"committed_blocks"`
	RemovedBlocks     uint64            `json:"removed_blocks_acked"`
	PublishedBlocks   uint64            `json:"published_blocks"`
	AckedBlocks       uint64            `json:"acked_blocks"`
	LostBlocks        int               `json:"lost_blocks"`
	ExtraBlocks       int               `json:"extra_blocks"`
	Failed            uint64            `json:"failed"`
	Duplicates        ingestDuplicates  `json:"duplicates"`
	Gaps              uint64            `json:"gaps"`
	Rejected          uint64            `json:"rejected"`
	Stale             int               `json:"stale_workers"`
	ElapsedS          float64           `json:"elapsed_s"`
	PublishS          float64           `json:"publish_s"`
	AckedEventsPerS   float64           `json:"acked_events_per_s"`
	PublishedBlocksPS float64           `json:"published_blocks_per_s"`
	VisibleAll        bool              `json:"visible_everywhere"`
	VisibleDetail     visibleDetail     `json:"visible"`
	Polling           []pollReport      `json:"polling"`
	Leader            leaderReport      `json:"leader"`
	JetStreamLeaders  jsLeaders         `json:"jetstream_leaders"`
	Shortfalls        []live.Shortfall  `json:"shortfalls,omitempty"`
	Notes             []string          `json:"notes"`
	Errors            []string          `json:"errors,omitempty"`
	Digests           map[string]string `json:"digests,omitempty"`
	// ReplicaCPU is each replica's process CPU time over the run and its
	// CPU µs per committed block event (issue 31 item 3).
	ReplicaCPU []replicaCPU `json:"replica_cpu"`
}

type ingestConfig struct {
	Target         string   `json:"target"`
	Replicas       []string `json:"replicas"`
	Discovery      string   `json:"discovery"`
	NATS           []string `json:"nats"`
	Model          string   `json:"model"`
	Workers        int      `json:"workers"`
	WorkerPrefix   string   `json:"worker_prefix"`
	BlocksPerEvent int      `json:"blocks_per_event"`
	BlockSize      int      `json:"block_size"`
	WorkerBlocks   int      `json:"worker_blocks"`
	Window         int      `json:"window"`
	EventsPerMsg   int      `json:"events_per_msg"`
	CompactHashes  bool     `json:"compact_hashes"`
	MaxUnapplied   int      `json:"max_unapplied"`
	DurationS      float64  `json:"duration_s"`
	PollMs         float64  `json:"poll_ms"`
	SampleEvery    int      `json:"sample_every"`
}

type ingestDuplicates struct {
	Stream uint64 `json:"stream"` // publishes the stream acknowledged as already stored
	FSM    uint64 `json:"fsm"`    // events the state machine skipped as already applied (cluster-wide, leader's count during the run)
}

type visibleDetail struct {
	Samples   int     `json:"samples"`
	Invisible int     `json:"invisible"`
	P90       float64 `json:"p90"`
	Max       float64 `json:"max"`
	Mean      float64 `json:"mean"`
}

type pollReport struct {
	Replica      string  `json:"replica"`
	Polls        int     `json:"polls"`
	Errors       int     `json:"errors"`
	MeanRTTMs    float64 `json:"mean_rtt_ms"`
	MaxRTTMs     float64 `json:"max_rtt_ms"`
	MeanPeriodMs float64 `json:"mean_period_ms"`
}

type leaderReport struct {
	Replica          string  `json:"replica"`
	Commands         uint64  `json:"commands"`
	Events           uint64  `json:"events"`
	EventsPerCommand float64 `json:"events_per_command"`
	RaftApplies      float64 `json:"raft_applies"`
	RaftApplyMeanMs  float64 `json:"raft_apply_mean_ms"`
	// From the consumer's metrics, when the replica registers them.
	ConsumerBatches     float64 `json:"consumer_batches,omitempty"`
	ConsumerBatchMeanMs float64 `json:"consumer_batch_mean_ms,omitempty"` // fetch → acks sent, commit included
	ConsumerEvents      float64 `json:"consumer_events,omitempty"`
}

// ingestWorker is one synthetic worker: its publisher and its ledger.
type ingestWorker struct {
	id  string
	pub *eventbus.Publisher
	nc  *nats.Conn

	published   atomic.Uint64
	acked       atomic.Uint64
	lastAcked   atomic.Uint64
	dups        atomic.Uint64
	failed      atomic.Uint64
	firstErr    atomic.Pointer[string]
	samples     []live.Sample
	firstSentNs int64
	// removals are the worker's removed events, in id order (written by
	// its generator only).
	removals []removal
}

type removal struct {
	id     uint64
	blocks int
}

// storedUpTo is how many stored blocks events 1..id carry.
func (w *ingestWorker) storedUpTo(id uint64, bpe int) int {
	n := id
	for _, r := range w.removals {
		if r.id <= id {
			n--
		}
	}
	return int(n) * bpe
}

// removedUpTo is how many blocks the removed events among 1..id remove.
func (w *ingestWorker) removedUpTo(id uint64) int {
	n := 0
	for _, r := range w.removals {
		if r.id <= id {
			n += r.blocks
		}
	}
	return n
}

func runIngest(args []string, stdout, stderr io.Writer) int {
	o, err := parseIngestFlags(args, stderr)
	if code, failed := cli.ParseFailed("ingest", err, stderr); failed {
		return code
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := executeIngest(ctx, o, stderr)
	if rep != nil {
		if o.JSON != "" {
			if werr := cli.WriteJSONFile(o.JSON, rep); werr != nil {
				return cli.Fail(stderr, "ingest", fmt.Errorf("write report: %w", werr), cli.ExitFail)
			}
		}
		fmt.Fprintln(stdout, ingestSummary(rep))
	}
	if err != nil {
		code := cli.ExitFail
		if errors.Is(err, cli.ErrUsage) {
			code = cli.ExitUsage
		}
		return cli.Fail(stderr, "ingest", err, code)
	}
	return cli.ExitOK
}

func ingestSummary(r *ingestReport) string {
	s := fmt.Sprintf("kvbench ingest: %.0f block events/s committed on every replica (%d blocks in %.2fs), visible p50 %.1f ms p99 %.1f ms (polls every ~%.0f ms), published %d, acked %d, lost %d",
		r.EventsPerS, r.CommittedBlocks, r.ElapsedS, r.VisibleMs.P50, r.VisibleMs.P99, meanPeriod(r.Polling), r.Published, r.Acked, r.Lost)
	if r.Duplicates.Stream+r.Duplicates.FSM > 0 {
		s += fmt.Sprintf(", duplicates %d stream / %d fsm", r.Duplicates.Stream, r.Duplicates.FSM)
	}
	if r.Failed > 0 {
		s += fmt.Sprintf(", failed %d", r.Failed)
	}
	if c := cpuSummary(r.ReplicaCPU); c != "" {
		s += "; " + c
	}
	return s
}

func meanPeriod(ps []pollReport) float64 {
	var sum float64
	for _, p := range ps {
		sum += p.MeanPeriodMs
	}
	if len(ps) == 0 {
		return 0
	}
	return sum / float64(len(ps))
}

// jsLeaders names the NATS servers (= replica node ids) leading the
// KV_EVENTS stream and the leader's durable consumer.
type jsLeaders struct {
	Stream   string `json:"stream"`
	Consumer string `json:"consumer"`
}

func streamLeaders(ctx context.Context, url string, opts []eventbus.ConnectOption) jsLeaders {
	var l jsLeaders
	nc, err := eventbus.Connect(url, "kvbench-probe", slog.New(slog.NewTextHandler(io.Discard, nil)), opts...)
	if err != nil {
		return l
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return l
	}
	if s, err := js.Stream(ctx, eventbus.StreamName); err == nil && s.CachedInfo().Cluster != nil {
		l.Stream = s.CachedInfo().Cluster.Leader
	}
	if c, err := js.Consumer(ctx, eventbus.StreamName, eventbus.DefaultDurable); err == nil && c.CachedInfo().Cluster != nil {
		l.Consumer = c.CachedInfo().Cluster.Leader
	}
	return l
}

func msOf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func randUint64() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	var v uint64
	for _, x := range b {
		v = v<<8 | uint64(x)
	}
	return v
}

// blockHash names block k of worker i: unique over the run (splitmix64 is
// a bijection of (seed + i<<40 + k) for k < 2^40) and, with a random seed,
// over runs.
func blockHash(seed uint64, worker int, k uint64) uint64 {
	return splitmix.Next(seed + uint64(worker)<<40 + k)
}

// generateEvents publishes worker w's events until ctx ends: one chain of stored
// blocks, each event's parent the previous event's last block, so the
// state machine accepts every one; when the worker would hold more than
// --worker-blocks, first one removed event for its oldest half. It pauses
// while more than perWorker events are published but not yet visible on
// every replica.
func generateEvents(ctx context.Context, w *ingestWorker, i int, o *ingestOptions, seed uint64, perWorker int, tr *live.Tracker) {
	blocks := make([]eventbus.WireBlock, o.BlocksPerEvent)
	var held []uint64 // oldest first
	chunk := 0
	if o.WorkerBlocks > 0 {
		chunk = min(max(o.WorkerBlocks/2, o.BlocksPerEvent), eventbus.DefaultMaxBlocks)
	}
	var k uint64 // blocks generated
	var parent uint64
	hasParent := false
	id := uint64(1)
	send := func(ev eventbus.WireEvent) bool {
		if perWorker > 0 {
			for id-1 > tr.MinCursor(i)+uint64(perWorker) {
				if ctx.Err() != nil {
					return false
				}
				time.Sleep(200 * time.Microsecond)
			}
		}
		ev.EventID = id
		if _, err := w.pub.PublishAsync(ctx, ev); err != nil {
			return false // ctx over (the event was not sent) or the publisher closed
		}
		now := time.Now()
		if id == 1 {
			w.firstSentNs = now.UnixNano()
		}
		w.published.Add(1)
		if id%uint64(o.SampleEvery) == 0 {
			w.samples = append(w.samples, live.Sample{Worker: i, ID: id, Sent: now})
		}
		id++
		return true
	}
	for ctx.Err() == nil {
		if chunk > 0 && len(held)+o.BlocksPerEvent > o.WorkerBlocks {
			n := min(chunk, len(held))
			rid := id
			if !send(eventbus.WireEvent{Kind: eventbus.KindRemoved, Removed: held[:n]}) {
				return
			}
			w.removals = append(w.removals, removal{id: rid, blocks: n})
			held = held[n:]
		}
		for b := range blocks {
			h := blockHash(seed, i, k)
			k++
			blocks[b] = eventbus.WireBlock{Engine: h, Content: h}
		}
		if !send(eventbus.WireEvent{Kind: eventbus.KindStored, BlockSize: o.BlockSize,
			HasParent: hasParent, Parent: parent, Blocks: blocks}) {
			return
		}
		if chunk > 0 {
			for _, b := range blocks {
				held = append(held, b.Engine)
			}
		}
		parent, hasParent = blocks[len(blocks)-1].Engine, true
	}
}

func pollReplica(ctx context.Context, cl *live.Client, url string, r int, every time.Duration, tr *live.Tracker) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		t0 := time.Now()
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		st, err := cl.Cursors(rctx, url)
		cancel()
		if ctx.Err() != nil {
			return
		}
		now := time.Now()
		if err != nil {
			st = nil
		}
		tr.Observe(r, now, now.Sub(t0), st)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func waitRegistered(ctx context.Context, cl *live.Client, replicas, ids []string) error {
	for {
		missing := ""
	check:
		for _, r := range replicas {
			st, err := cl.Status(ctx, r)
			if err != nil {
				missing = fmt.Sprintf("%s: %v", r, err)
				break
			}
			for _, id := range ids {
				if _, ok := st.Worker(id); !ok {
					missing = fmt.Sprintf("%s not yet registered on %s", id, r)
					break check
				}
			}
		}
		if missing == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("synthetic workers not registered on every replica: %s", missing)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// waitVisible waits until every worker's last acknowledged event is visible
// on every replica.
func waitVisible(ctx context.Context, ws []*ingestWorker, tr *live.Tracker) bool {
	for {
		all := true
		for i, w := range ws {
			if last := w.lastAcked.Load(); last > 0 {
				if _, ok := tr.Visible(i, last); !ok {
					all = false
					break
				}
			}
		}
		if all {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// ingestMeter is the run's progress: seconds of --duration gone, and
// what was published, acknowledged and seen on every replica so far.
func ingestMeter(o *ingestOptions, ws []*ingestWorker, tr *live.Tracker, start time.Time) progress.Meter {
	secs := int64(o.Duration.Seconds() + 0.5)
	return progress.Meter{
		Name: "kvbench ingest", Unit: "s", Total: max(secs, 1),
		Count: func() int64 { return min(int64(time.Since(start).Seconds()), secs) },
		Detail: func() string {
			var pub, acked, vis uint64
			for i, w := range ws {
				pub += w.published.Load()
				acked += w.acked.Load()
				vis += tr.MinCursor(i)
			}
			el := max(time.Since(start).Seconds(), 1e-3)
			return fmt.Sprintf("published %d, acked %d, visible everywhere %d (%.0f/s)", pub, acked, vis, float64(vis)/el)
		},
	}
}
