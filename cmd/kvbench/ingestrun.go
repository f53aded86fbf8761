package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/live"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/progress"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"github.com/kvrouter/kvrouter/eventbus"
)

// leaderMetricNames are the metrics read from the Raft leader before and
// after the run.
func leaderMetricNames() []string {
	return []string{"kvrouter_raft_apply_seconds_sum", "kvrouter_raft_apply_seconds_count",
		"kvrouter_eventbus_batch_seconds_sum", "kvrouter_eventbus_batch_seconds_count", "kvrouter_eventbus_events_applied_total"}
}

// executeIngest runs the benchmark: setup, generate, measure, report. It
// returns a report whenever it got as far as publishing (with an error too
// when something is wrong with it).
func executeIngest(ctx context.Context, o *ingestOptions, stderr io.Writer) (*ingestReport, error) {
	r, err := setupIngest(ctx, o, stderr)
	if err != nil {
		return nil, err
	}
	defer r.close()
	pub := r.generate(ctx)
	m := r.measure(ctx, pub)
	return r.report(m)
}

// ingestRun is one run of kvbench ingest, from setup to report.
type ingestRun struct {
	o      *ingestOptions
	cl     *live.Client
	logf   func(format string, args ...any)
	stderr io.Writer

	cluster  ingestCluster
	prefix   string // the synthetic workers' id prefix
	ids      []string
	ws       []*ingestWorker
	tr       *live.Tracker
	baseline []*live.Status     // every replica's status before publishing (nil: unknown)
	before   map[string]float64 // the leader's metrics before publishing
	cpu0     []float64          // every replica's process CPU seconds before publishing (NaN: unknown)

	stopPolling  func()   // idempotent; set by generate
	stopProgress func()   // idempotent; set by generate
	cleanups     []func() // run last first by close
}

// ingestCluster is what setup learned about the cluster behind --target.
type ingestCluster struct {
	replicas  []string // HTTP base URLs
	names     []string // their node ids, in the same order
	target    *live.Status
	how       string // how the replicas were found
	natsURLs  []string
	leaders   jsLeaders
	model     string
	leaderURL string // the Raft leader's HTTP URL; "" when unknown
}

// publishWindow is when generate published.
type publishWindow struct{ start, end time.Time }

// ingestMeasurement is what measure saw after publishing.
type ingestMeasurement struct {
	publishWindow
	errs       []string
	visibleAll bool
	finals     []*live.Status // every replica's final status (nil: unreachable)
	after      map[string]float64
	cpu1       []float64 // every replica's process CPU seconds after the drain (NaN: unknown)
}

// close undoes setup: stops polling, closes the publishers, stops renewing
// the registrations and deregisters the workers, in that order.
func (r *ingestRun) close() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
	r.cleanups = nil
}

// setupIngest finds the cluster, registers the synthetic workers (known to
// every replica before it returns) and connects their publishers. On error
// it has undone whatever it did.
func setupIngest(ctx context.Context, o *ingestOptions, stderr io.Writer) (_ *ingestRun, err error) {
	r := &ingestRun{o: o, cl: live.NewClient(o.AdminToken), stderr: stderr,
		logf: func(format string, args ...any) { fmt.Fprintf(stderr, "kvbench ingest: "+format+"\n", args...) }}
	defer func() {
		if err != nil {
			r.close()
		}
	}()
	if o.AdminTokenFrom != "" {
		r.logf("admin token from %s", o.AdminTokenFrom)
	}
	if r.cluster, err = discoverCluster(ctx, r.cl, o, r.logf); err != nil {
		return nil, err
	}
	c := &r.cluster
	r.logf("replicas %s (%s); NATS %s (stream leader %s, consumer leader %s, raft leader %s); model %s", strings.Join(c.replicas, ", "), c.how,
		strings.Join(c.natsURLs, ","), cmp.Or(c.leaders.Stream, "?"), cmp.Or(c.leaders.Consumer, "?"), cmp.Or(c.target.LeaderID, "?"), c.model)

	r.prefix = "ingest-" + randHex(4)
	r.ws = make([]*ingestWorker, o.Workers)
	r.ids = make([]string, o.Workers)
	for i := range r.ws {
		r.ids[i] = fmt.Sprintf("%s-%d", r.prefix, i)
		r.ws[i] = &ingestWorker{id: r.ids[i]}
	}
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	if err := r.registerWorkers(ctx, rctx); err != nil {
		return nil, err
	}
	r.baseline = make([]*live.Status, len(c.replicas))
	for i, u := range c.replicas {
		r.baseline[i], _ = r.cl.Status(rctx, u)
	}
	if c.leaderURL != "" {
		r.before, _ = r.cl.Metrics(rctx, c.leaderURL, leaderMetricNames()...)
	}
	if err := r.connectPublishers(); err != nil {
		return nil, err
	}
	// Last before publishing, so setup's registrations and connections are
	// not charged to the events.
	r.cpu0 = replicaCPUSeconds(rctx, r.cl, c.replicas)
	return r, nil
}

// discoverCluster finds the replicas (--replicas or the target's
// registry), their node ids, the NATS URL to publish to and the model.
func discoverCluster(ctx context.Context, cl *live.Client, o *ingestOptions, logf func(string, ...any)) (ingestCluster, error) {
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c := ingestCluster{how: "--replicas"}
	if len(o.Replicas) > 0 {
		st, err := cl.Status(dctx, o.Target)
		if err != nil {
			return c, fmt.Errorf("target status: %w", err)
		}
		c.replicas, c.target = o.Replicas, st
	} else {
		d, err := cl.Discover(dctx, o.Target)
		if err != nil {
			return c, fmt.Errorf("target status: %w", err)
		}
		c.replicas, c.target, c.how = d.Replicas, d.Target, d.How
		if len(d.Unresolved) > 0 {
			logf("warning: no HTTP address found for peer(s) %s; checking visibility on %d replica(s) only (give --replicas)", strings.Join(d.Unresolved, ", "), len(c.replicas))
		}
	}
	c.names = make([]string, len(c.replicas))
	natsOf := map[string]string{} // node id → its NATS client URL
	for i, u := range c.replicas {
		st, err := cl.Status(dctx, u)
		if err != nil {
			return c, fmt.Errorf("replica %s: %w", u, err)
		}
		c.names[i] = st.NodeID
		if checkNATSURL(st.NATSURL) == nil {
			natsOf[st.NodeID] = st.NATSURL
		}
		if st.NodeID == c.target.LeaderID {
			c.leaderURL = u
		}
	}
	var err error
	if c.natsURLs, c.leaders, err = chooseNATS(dctx, o, c.target, natsOf); err != nil {
		return c, err
	}
	c.model = o.Model
	if c.model == "" {
		if len(c.target.Models) == 0 {
			return c, fmt.Errorf("the cluster reports no model: give --model")
		}
		c.model = c.target.Models[0]
	}
	return c, nil
}

// chooseNATS is --nats, or else the NATS server leading the event stream
// (one hop less), or else the target's.
func chooseNATS(ctx context.Context, o *ingestOptions, target *live.Status, natsOf map[string]string) ([]string, jsLeaders, error) {
	if urls := splitList(o.NATS); len(urls) > 0 {
		return urls, jsLeaders{}, nil
	}
	if target.NATSURL == "" {
		return nil, jsLeaders{}, fmt.Errorf("the target's /cluster/status has no nats_url: give --nats")
	}
	if err := checkNATSURL(target.NATSURL); err != nil {
		return nil, jsLeaders{}, fmt.Errorf("the target's nats_url: %w (give --nats)", err)
	}
	opts, err := o.natsOptions()
	if err != nil {
		return nil, jsLeaders{}, err
	}
	leaders := streamLeaders(ctx, target.NATSURL, opts)
	if u, ok := natsOf[leaders.Stream]; ok {
		return []string{u}, leaders, nil
	}
	return []string{target.NATSURL}, leaders, nil
}

// workerSpec is the registration of synthetic worker id.
func (r *ingestRun) workerSpec(id string) live.WorkerSpec {
	capacity := r.o.WorkerBlocks
	if capacity == 0 {
		capacity = 1 << 20
	}
	return live.WorkerSpec{ID: id, URL: "http://127.0.0.1:1", Model: r.cluster.model, BlockSize: r.o.BlockSize,
		TotalBlocks: capacity, MaxBatchedTokens: 8192}
}

// registerWorkers registers the synthetic workers, waits until every
// replica knows them, and renews their leases until close.
func (r *ingestRun) registerWorkers(ctx, rctx context.Context) error {
	var registered []string
	r.cleanups = append(r.cleanups, func() { r.deregister(registered) })
	for _, id := range r.ids {
		err := r.cl.Register(rctx, r.o.Target, r.workerSpec(id))
		if err != nil {
			var he *live.HTTPError
			if errors.As(err, &he) && he.Status == 400 {
				return fmt.Errorf("%w: registering %s: %v", cli.ErrUsage, id, err)
			}
			return fmt.Errorf("registering %s: %w", id, err)
		}
		registered = append(registered, id)
	}
	if err := waitRegistered(rctx, r.cl, r.cluster.replicas, r.ids); err != nil {
		return err
	}
	r.cleanups = append(r.cleanups, r.renewLeases(ctx))
	return nil
}

// deregister removes the workers setup registered, unless --keep-workers.
func (r *ingestRun) deregister(ids []string) {
	if r.o.KeepWorkers {
		return
	}
	cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var failed []string
	for _, id := range ids {
		if err := r.cl.Deregister(cctx, r.o.Target, id); err != nil {
			failed = append(failed, fmt.Sprintf("%s (%v)", id, err))
		}
	}
	if len(failed) > 0 {
		r.logf("warning: could not deregister %s; their leases expire in 2 minutes", strings.Join(failed, ", "))
	}
}

// renewLeases re-registers the workers every 30 s (registrations are
// 2-minute leases) until the returned function is called.
func (r *ingestRun) renewLeases(ctx context.Context) (stop func()) {
	renewCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(30 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-renewCtx.Done():
				return
			case <-t.C:
			}
			for _, id := range r.ids {
				c, cancel := context.WithTimeout(renewCtx, 5*time.Second)
				if err := r.cl.Register(c, r.o.Target, r.workerSpec(id)); err != nil && renewCtx.Err() == nil {
					r.logf("warning: renewing %s: %v", id, err)
				}
				cancel()
			}
		}
	}()
	return func() { cancel(); <-done }
}

// connectPublishers gives every worker its NATS connection and publisher;
// worker i uses NATS URL i mod n.
func (r *ingestRun) connectPublishers() error {
	r.cleanups = append(r.cleanups, func() {
		for _, w := range r.ws {
			if w.pub != nil {
				w.pub.Close()
			}
			if w.nc != nil {
				w.nc.Close()
			}
		}
	})
	quiet := slog.New(slog.NewTextHandler(r.stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	urls := r.cluster.natsURLs
	natsOpts, err := r.o.natsOptions()
	if err != nil {
		return err
	}
	for i, w := range r.ws {
		nc, err := eventbus.Connect(urls[i%len(urls)], "kvbench-"+w.id, quiet, natsOpts...)
		if err != nil {
			return fmt.Errorf("NATS %s: %w", urls[i%len(urls)], err)
		}
		w.nc = nc
		popts := []eventbus.PublisherOption{
			eventbus.WithWindow(r.o.Window),
			eventbus.WithBatching(r.o.EventsPerMsg, 0, time.Millisecond),
			eventbus.WithPublisherLogger(quiet),
			eventbus.WithOnAck(func(a eventbus.PublishAck) {
				w.acked.Add(1)
				w.lastAcked.Store(a.EventID)
				if a.Duplicate {
					w.dups.Add(1)
				}
			}),
			eventbus.WithOnError(func(id uint64, err error) {
				w.failed.Add(1)
				s := err.Error()
				w.firstErr.CompareAndSwap(nil, &s)
			}),
		}
		if r.o.CompactHashes {
			popts = append(popts, eventbus.WithCompactHashes())
		}
		w.pub, err = eventbus.NewPublisher(nc, w.id, 0, popts...)
		if err != nil {
			return fmt.Errorf("publisher of %s: %w", w.id, err)
		}
	}
	return nil
}

// generate starts polling every replica's status, each on its own cadence,
// then publishes every worker's events for --duration.
func (r *ingestRun) generate(ctx context.Context) publishWindow {
	r.tr = live.NewTracker(r.ids, len(r.cluster.replicas))
	pctx, pcancel := context.WithCancel(ctx)
	var pwg sync.WaitGroup
	for i, u := range r.cluster.replicas {
		pwg.Add(1)
		go func() {
			defer pwg.Done()
			pollReplica(pctx, r.cl, u, i, r.o.Poll, r.tr)
		}()
	}
	r.stopPolling = sync.OnceFunc(func() { pcancel(); pwg.Wait() })
	r.cleanups = append(r.cleanups, r.stopPolling)

	seed := randUint64()
	perWorker := 0
	if r.o.MaxUnapplied > 0 {
		perWorker = max(r.o.MaxUnapplied/r.o.Workers, 1)
	}
	start := time.Now()
	r.stopProgress = progress.Start(r.stderr, ingestMeter(r.o, r.ws, r.tr, start), r.o.Progress.Options(r.stderr))
	r.cleanups = append(r.cleanups, r.stopProgress)
	pubCtx, pubCancel := context.WithDeadline(ctx, start.Add(r.o.Duration))
	defer pubCancel()
	var gwg sync.WaitGroup
	for i, w := range r.ws {
		gwg.Add(1)
		go func() {
			defer gwg.Done()
			generateEvents(pubCtx, w, i, r.o, seed, perWorker, r.tr)
		}()
	}
	gwg.Wait()
	return publishWindow{start: start, end: time.Now()}
}

// measure waits until every event is acknowledged and visible everywhere
// (or --drain-timeout), stops polling, and reads every replica's final
// status and the leader's metrics.
func (r *ingestRun) measure(ctx context.Context, pub publishWindow) ingestMeasurement {
	m := ingestMeasurement{publishWindow: pub}
	drainCtx, drainCancel := context.WithTimeout(ctx, r.o.DrainTimeout)
	defer drainCancel()
	for _, w := range r.ws {
		if err := w.pub.Flush(drainCtx); err != nil {
			m.errs = append(m.errs, fmt.Sprintf("%s: %v", w.id, err))
		}
	}
	m.visibleAll = waitVisible(drainCtx, r.ws, r.tr)
	// First after the drain, so the idle time until the status reads below
	// is not charged to the events.
	cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
	m.cpu1 = replicaCPUSeconds(cctx, r.cl, r.cluster.replicas)
	ccancel()
	r.stopProgress()
	r.stopPolling()
	// Give in-flight events a last chance to be reported as failed.
	for _, w := range r.ws {
		w.pub.Close()
	}
	fctx, fcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer fcancel()
	m.finals = make([]*live.Status, len(r.cluster.replicas))
	for i, u := range r.cluster.replicas {
		m.finals[i], _ = r.cl.StatusWithDigest(fctx, u)
	}
	if r.cluster.leaderURL != "" {
		m.after, _ = r.cl.Metrics(fctx, r.cluster.leaderURL, leaderMetricNames()...)
	}
	return m
}

// report computes the figures from what measure saw; the error says what
// is wrong with the run (events not visible in time, or lost).
func (r *ingestRun) report(m ingestMeasurement) (*ingestReport, error) {
	o, c := r.o, &r.cluster
	rep := &ingestReport{Unit: "block events (one stored block = one block event)", Config: r.reportConfig(),
		VisibleAll: m.visibleAll, Errors: m.errs, JetStreamLeaders: c.leaders}
	exp, samples, firstSent, lastVisible := r.tallyWorkers(rep)
	lost := live.CountLost(exp, o.BlocksPerEvent, c.names, m.finals)
	rep.Lost, rep.LostBlocks, rep.ExtraBlocks, rep.Shortfalls = lost.Events, lost.Blocks, lost.ExtraBlocks, lost.Detail
	committed, stale := r.committedBlocks(m.finals)
	rep.CommittedBlocks, rep.Stale = max(committed-lost.Blocks, 0), stale
	rep.PublishS = m.end.Sub(m.start).Seconds()
	if !firstSent.IsZero() && lastVisible.After(firstSent) {
		rep.ElapsedS = lastVisible.Sub(firstSent).Seconds()
		rep.EventsPerS = float64(rep.CommittedBlocks) / rep.ElapsedS
	}
	if rep.PublishS > 0 {
		rep.AckedEventsPerS = float64(rep.Acked) / rep.PublishS
		rep.PublishedBlocksPS = float64(rep.PublishedBlocks) / rep.PublishS
	}
	rep.VisibleMs, rep.VisibleDetail = visibleFigures(r.tr, samples)
	for i, p := range r.tr.Polls() {
		rep.Polling = append(rep.Polling, pollReport{Replica: c.names[i], Polls: p.Polls, Errors: p.Errors,
			MeanRTTMs: msOf(p.MeanRTT()), MaxRTTMs: msOf(p.MaxRTT), MeanPeriodMs: msOf(p.MeanPeriod())})
	}
	r.fsmFigures(rep, m.finals)
	rep.ReplicaCPU = cpuPerBlockEvent(c.names, r.cpu0, m.cpu1, rep.CommittedBlocks)
	if r.before != nil && m.after != nil {
		leaderMetrics(&rep.Leader, r.before, m.after)
	}
	rep.Digests = map[string]string{}
	for i, st := range m.finals {
		if st != nil {
			rep.Digests[c.names[i]] = st.Digest
		}
	}
	rep.Notes = ingestNotes(o.SampleEvery)
	if !m.visibleAll {
		return rep, fmt.Errorf("not every acknowledged event became visible on every replica within --drain-timeout %v", o.DrainTimeout)
	}
	if rep.Lost > 0 {
		return rep, fmt.Errorf("%d acknowledged events (%d blocks) missing on some replica", rep.Lost, rep.LostBlocks)
	}
	return rep, nil
}

func (r *ingestRun) reportConfig() ingestConfig {
	o, c := r.o, &r.cluster
	return ingestConfig{Target: o.Target, Replicas: c.replicas, Discovery: c.how, NATS: c.natsURLs, Model: c.model,
		Workers: o.Workers, WorkerPrefix: r.prefix, BlocksPerEvent: o.BlocksPerEvent, BlockSize: o.BlockSize, WorkerBlocks: o.WorkerBlocks,
		Window: o.Window, EventsPerMsg: o.EventsPerMsg, CompactHashes: o.CompactHashes, MaxUnapplied: o.MaxUnapplied, DurationS: o.Duration.Seconds(),
		PollMs: float64(o.Poll) / float64(time.Millisecond), SampleEvery: o.SampleEvery}
}

// tallyWorkers adds up the workers' ledgers into rep and returns what
// every replica should hold of each worker, the visibility samples, the
// first publish and the moment the last acknowledged events were visible
// everywhere.
func (r *ingestRun) tallyWorkers(rep *ingestReport) (exp []live.Expectation, samples []live.Sample, firstSent, lastVisible time.Time) {
	bpe := r.o.BlocksPerEvent
	exp = make([]live.Expectation, len(r.ws))
	for i, w := range r.ws {
		rep.Published += w.published.Load()
		rep.Acked += w.acked.Load()
		rep.Failed += w.failed.Load()
		rep.Duplicates.Stream += w.dups.Load()
		if p := w.firstErr.Load(); p != nil {
			rep.Errors = append(rep.Errors, fmt.Sprintf("%s: %s", w.id, *p))
		}
		last := w.lastAcked.Load()
		exp[i] = live.Expectation{Worker: w.id, LastAcked: last, AckedEvents: w.acked.Load(),
			Blocks: w.storedUpTo(last, bpe) - w.removedUpTo(last), Unsure: w.failed.Load() > 0}
		rep.AckedBlocks += uint64(w.storedUpTo(last, bpe))
		rep.RemovedBlocks += uint64(w.removedUpTo(last))
		rep.PublishedBlocks += uint64(w.storedUpTo(w.published.Load(), bpe))
		samples = append(samples, w.samples...)
		if w.firstSentNs != 0 {
			if t := time.Unix(0, w.firstSentNs); firstSent.IsZero() || t.Before(firstSent) {
				firstSent = t
			}
		}
		if last > 0 {
			if at, ok := r.tr.Visible(i, last); ok && at.After(lastVisible) {
				lastVisible = at
			}
		}
	}
	return exp, samples, firstSent, lastVisible
}

// committedBlocks is the stored blocks of the events every replica's
// cursor covers (the slowest replica's), and how many workers some
// replica holds as stale.
func (r *ingestRun) committedBlocks(finals []*live.Status) (blocks, stale int) {
	for i, w := range r.ws {
		cur := w.lastAcked.Load()
		isStale := false
		for _, st := range finals {
			c := uint64(0)
			if st != nil {
				if wk, ok := st.Worker(r.ids[i]); ok && len(wk.Ranks) > 0 {
					c = wk.Ranks[0].LastEventID
					isStale = isStale || wk.Ranks[0].Stale != ""
				}
			}
			cur = min(cur, c)
		}
		if isStale {
			stale++
		}
		blocks += w.storedUpTo(cur, r.o.BlocksPerEvent)
	}
	return blocks, stale
}

// visibleFigures are the publish-to-visible latencies of the samples.
func visibleFigures(tr *live.Tracker, samples []live.Sample) (stats.Quantiles, visibleDetail) {
	lat, invisible := tr.Latencies(samples)
	d := visibleDetail{Samples: len(samples), Invisible: invisible}
	if len(lat) == 0 {
		return stats.Quantiles{}, d
	}
	d.Mean = stats.Mean(lat)
	d.P90 = stats.Percentile(lat, 90)
	d.Max = slices.Max(lat)
	return stats.Of(lat), d
}

// fsmFigures are the state machines' counters over the run: the worst
// replica's gaps and rejections, the leader's duplicates and batching.
func (r *ingestRun) fsmFigures(rep *ingestReport, finals []*live.Status) {
	for i := range finals {
		if finals[i] == nil || r.baseline[i] == nil {
			continue
		}
		d, b := finals[i].FSM, r.baseline[i].FSM
		rep.Gaps = max(rep.Gaps, d.Gaps-b.Gaps)
		rep.Rejected = max(rep.Rejected, d.Rejections()-b.Rejections())
		if name := r.cluster.names[i]; name == r.cluster.target.LeaderID {
			rep.Duplicates.FSM = d.Duplicates - b.Duplicates
			rep.Leader = leaderReport{Replica: name, Commands: d.Commands - b.Commands, Events: d.Events - b.Events}
			if rep.Leader.Commands > 0 {
				rep.Leader.EventsPerCommand = float64(rep.Leader.Events) / float64(rep.Leader.Commands)
			}
		}
	}
}

// leaderMetrics fills l from the leader's Prometheus counters before and
// after the run.
func leaderMetrics(l *leaderReport, before, after map[string]float64) {
	delta := func(name string) float64 { return after[name] - before[name] }
	n, s := delta("kvrouter_raft_apply_seconds_count"), delta("kvrouter_raft_apply_seconds_sum")
	l.RaftApplies = n
	if n > 0 {
		l.RaftApplyMeanMs = 1000 * s / n
	}
	bn, bs := delta("kvrouter_eventbus_batch_seconds_count"), delta("kvrouter_eventbus_batch_seconds_sum")
	l.ConsumerBatches = bn
	l.ConsumerEvents = delta("kvrouter_eventbus_events_applied_total")
	if bn > 0 {
		l.ConsumerBatchMeanMs = 1000 * bs / bn
	}
}

// ingestNotes say in the report what each figure measures.
func ingestNotes(sampleEvery int) []string {
	return []string{
		"events_per_s: stored blocks of the acknowledged events that every replica applied (the slowest replica's cursors, less blocks found missing), divided by the time from the first publish to the moment every worker's last acknowledged event was visible on every replica; removed blocks (evictions past --worker-blocks) are not counted",
		fmt.Sprintf("visible_ms: publish (PublishAsync returned) to the first /cluster/status answer of the LAST replica whose last_event_id covered the event; every %dth event of each worker; an upper bound, late by up to one poll period plus one status round trip (see polling)", sampleEvery),
		"lost: acknowledged events missing on some replica at the end: past its cursor, or fewer blocks than acknowledged (cursor consumed but blocks rejected)",
		"the synthetic workers register with url http://127.0.0.1:1: nothing should be routed to them, but a request for the same model during the run could be, and would fail over",
		"duplicates.fsm is the leader's cluster-wide count of events skipped as already applied during the run",
	}
}
