package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/cli"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/live"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/progress"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/report"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/sim"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/stats"
	"github.com/kvrouter/kvrouter/cmd/kvbench/internal/workload"
	"github.com/kvrouter/kvrouter/internal/pki"
)

// loadOptions are kvbench load's validated flags.
type loadOptions struct {
	Targets []string
	Direct  string
	Model   string
	APIKey  string
	Token   string // admin token, for the capacity behind the reference figures
	CAFile  string // CA that https endpoints are checked against ("" : the system roots)
	// WorkerKey is sent to --direct instead of APIKey: a worker started
	// with --api-key (make run's kvmocks) takes its own key, not the
	// router's (secrets.go).
	WorkerKey string
	// Where Token and WorkerKey came from (secrets.go), "" for none.
	TokenFrom, WorkerKeyFrom string

	cli.Workload
	SLO       cli.SLO
	BlockSize int
	Seed      uint64
	Salt      uint32
	SaltSet   bool

	Timeout     time.Duration
	MaxDuration time.Duration
	JSON        string
	Progress    progress.Flags
}

func parseLoadFlags(args []string, output io.Writer) (*loadOptions, error) {
	o := &loadOptions{}
	fs := flag.NewFlagSet("kvbench load", flag.ContinueOnError)
	fs.SetOutput(output)
	var targets string
	var salt uint
	fs.StringVar(&targets, "target", "", "comma list of OpenAI endpoints (replicas' base URLs); requests go round-robin over them")
	fs.StringVar(&o.Direct, "direct", "", "a worker's base URL: send the same workload straight to it (alone, or as a second pass after --target: router overhead)")
	fs.StringVar(&o.Model, "model", "", "model name in the requests (default: the first of the first endpoint's /v1/models)")
	fs.StringVar(&o.APIKey, "api-key", os.Getenv("KVROUTER_API_KEY"), "bearer API key for the inference endpoints (default $KVROUTER_API_KEY)")
	token := registerSecret(fs, "admin-token", "KVROUTER_ADMIN_TOKEN", defaultRunAdminToken, "admin bearer token, to read the workers' capacity for the reference figures")
	workerKey := registerSecret(fs, "worker-api-key", "KVROUTER_WORKER_API_KEY", defaultRunWorkerKey, "bearer key sent to the --direct worker (its --api-key) instead of --api-key")
	fs.StringVar(&o.CAFile, "ca", os.Getenv("KVROUTER_CA_FILE"), "PEM CA to trust for https:// endpoints (default $KVROUTER_CA_FILE, else make run's "+defaultRunCA+" when it exists and an endpoint is https)")
	o.Workload.Register(fs)
	o.SLO.Register(fs)
	fs.IntVar(&o.BlockSize, "block-size", 16, "tokens per KV block, for the hit rule and the reference figures")
	fs.Uint64Var(&o.Seed, "seed", 1, "workload seed (the same seed is the same workload as kvbench sim's)")
	fs.UintVar(&salt, "salt", 0, "shifts every prompt word, so a run does not hit the caches an earlier run filled; same structure, different text (default: random per run; the direct pass uses salt+1)")
	fs.DurationVar(&o.Timeout, "timeout", 60*time.Second, "per-request timeout")
	fs.DurationVar(&o.MaxDuration, "max-duration", 10*time.Minute, "a pass sends no new request after this long")
	fs.StringVar(&o.JSON, "json", "", "write the JSON report to this file")
	o.Progress.Register(fs)
	if err := cli.Parse(fs, args); err != nil {
		return nil, err
	}
	if err := o.Progress.Check(); err != nil {
		return nil, cli.Usagef("%v", err)
	}
	o.SaltSet = cli.Given(fs)["salt"]
	var err error
	if o.Token, o.TokenFrom, err = token.resolve(); err != nil {
		return nil, cli.Usagef("%v", err)
	}
	if o.WorkerKey, o.WorkerKeyFrom, err = workerKey.resolve(); err != nil {
		return nil, cli.Usagef("%v", err)
	}
	if salt > 1<<31 {
		return nil, cli.Usagef("--salt %d: at most 2^31", salt)
	}
	o.Salt = uint32(salt)
	for _, t := range splitList(targets) {
		u, err := live.ParseLocalURL(t)
		if err != nil {
			return nil, cli.Usagef("--target: %v", err)
		}
		if slices.Contains(o.Targets, u) {
			return nil, cli.Usagef("--target lists %s twice", u)
		}
		o.Targets = append(o.Targets, u)
	}
	if targets != "" && len(o.Targets) == 0 {
		return nil, cli.Usagef("--target %q: no URL", targets)
	}
	if o.Direct != "" {
		u, err := live.ParseLocalURL(o.Direct)
		if err != nil {
			return nil, cli.Usagef("--direct: %v", err)
		}
		o.Direct = u
	}
	if len(o.Targets) == 0 && o.Direct == "" {
		return nil, cli.Usagef("--target URL[,URL…] or --direct URL is required")
	}
	if err := o.Workload.Check(); err != nil {
		return nil, err
	}
	if err := o.Workload.CheckArrival(cli.Given(fs)); err != nil {
		return nil, err
	}
	if err := o.SLO.Check(); err != nil {
		return nil, err
	}
	// Real time and real memory: bounds sim does not need.
	switch {
	case o.PrefixTokens+o.TailTokens > 1<<20:
		return nil, cli.Usagef("--prefix-tokens + --tail-tokens: at most %d tokens", 1<<20)
	case o.Requests > 1_000_000:
		return nil, cli.Usagef("--requests %d: want 1..1000000", o.Requests)
	case o.Concurrency > 1024:
		return nil, cli.Usagef("--concurrency %d: want 1..1024", o.Concurrency)
	case o.ArrivalRate > 10000:
		return nil, cli.Usagef("--arrival-rate %v: at most 10000 requests/s", o.ArrivalRate)
	case o.BlockSize < 1:
		return nil, cli.Usagef("--block-size %d: must be positive", o.BlockSize)
	case o.Timeout <= 0:
		return nil, cli.Usagef("--timeout %v: must be positive", o.Timeout)
	case o.MaxDuration <= 0:
		return nil, cli.Usagef("--max-duration %v: must be positive", o.MaxDuration)
	}
	return o, nil
}

// loadConfig is the report's "config".
type loadConfig struct {
	Workload    string   `json:"workload"`
	Targets     []string `json:"targets,omitempty"`
	Direct      string   `json:"direct,omitempty"`
	DirectID    string   `json:"direct_worker,omitempty"`
	Model       string   `json:"model"`
	BlockSize   int      `json:"block_size"`
	Seed        uint64   `json:"seed"`
	Salt        uint32   `json:"salt"`
	Synthetic   synthCfg `json:"synthetic"`
	Requests    int      `json:"requests"`
	HitRule     string   `json:"hit_rule"`
	Capacity    int      `json:"capacity_blocks"`
	TimeoutS    float64  `json:"timeout_s"`
	SLO         *sloCfg  `json:"slo,omitempty"`
	Denominator string   `json:"denominator"` // what every ratio and quantile is over (sim.Denominator)
	WallSeconds float64  `json:"wall_seconds"`
	Notes       []string `json:"notes"`
}

// liveResult is a report row with the live extras.
type liveResult struct {
	report.Result
	Endpoints      []string           `json:"endpoints"`
	NotSent        int                `json:"not_sent"`
	NoUsage        int                `json:"no_usage"`
	PromptMismatch int                `json:"prompt_token_mismatches"`
	PerWorker      []workerFigures    `json:"per_worker"`
	ErrorSamples   []string           `json:"error_samples,omitempty"`
	PerEndpoint    map[string]float64 `json:"ttft_p50_ms_per_endpoint,omitempty"`
}

type workerFigures struct {
	Worker   string          `json:"worker"`
	Requests int             `json:"requests"`
	HitRate  float64         `json:"request_hit_rate"`
	TTFT     stats.Quantiles `json:"ttft_ms"`
}

type loadReport struct {
	Config    loadConfig       `json:"config"`
	Reference report.Reference `json:"reference"`
	Results   []liveResult     `json:"results"`
}

func runLoad(args []string, stdout, stderr io.Writer) int {
	o, err := parseLoadFlags(args, stderr)
	if code, failed := cli.ParseFailed("load", err, stderr); failed {
		return code
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := executeLoad(ctx, o, stderr)
	if err != nil {
		code := cli.ExitFail
		if errors.Is(err, cli.ErrUsage) || errors.Is(err, workload.ErrSpec) {
			code = cli.ExitUsage
		}
		return cli.Fail(stderr, "load", err, code)
	}
	for _, r := range rep.Results {
		fmt.Fprintln(stdout, loadSummary(rep, &r))
	}
	if o.JSON != "" {
		if err := cli.WriteJSONFile(o.JSON, rep); err != nil {
			return cli.Fail(stderr, "load", fmt.Errorf("write report: %w", err), cli.ExitFail)
		}
	}
	for _, r := range rep.Results {
		if r.Completed == 0 {
			return cli.ExitFail
		}
	}
	return cli.ExitOK
}

func loadSummary(rep *loadReport, r *liveResult) string {
	return fmt.Sprintf("kvbench load %s via %s: %d requests, hit rate %.1f%%, cached ratio %.3f, TTFT p50 %.1f ms p99 %.1f ms, E2E p50 %.1f ms p99 %.1f ms, %.2f req/s, %d errors (reference: pooled-LRU %.3f, ideal %.3f)",
		r.Policy, strings.Join(r.Endpoints, ","), r.Requests, 100*r.RequestHitRate, r.CachedTokenRatio, r.TTFT.P50, r.TTFT.P99,
		r.E2E.P50, r.E2E.P99, r.ThroughputRPS, r.Errors, rep.Reference.PooledLRUCachedTokenRatio, rep.Reference.IdealCachedTokenRatio)
}

func executeLoad(ctx context.Context, o *loadOptions, stderr io.Writer) (*loadReport, error) {
	start := time.Now()
	w, err := workload.NewSynthetic(o.Workload.Spec(o.BlockSize, o.Seed))
	if err != nil {
		return nil, err
	}
	tlsConf, err := o.clientTLS()
	if err != nil {
		return nil, err
	}
	if o.TokenFrom != "" {
		fmt.Fprintf(stderr, "kvbench load: admin token from %s\n", o.TokenFrom)
	}
	if o.Direct != "" && o.WorkerKeyFrom != "" {
		fmt.Fprintf(stderr, "kvbench load: worker API key (for --direct) from %s\n", o.WorkerKeyFrom)
	}
	conns := o.Concurrency
	if o.ArrivalRate > 0 {
		conns = maxInFlight
	}
	hc := live.NewInferenceClient(conns, tlsConf)
	cl := live.NewClient(o.Token)
	cl.HTTP.Transport.(*http.Transport).TLSClientConfig = tlsConf
	first := o.Direct
	if len(o.Targets) > 0 {
		first = o.Targets[0]
	}
	ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	model := o.Model
	if model == "" {
		ms, err := live.Models(ictx, hc, first, o.keyFor(first))
		if err != nil {
			return nil, fmt.Errorf("listing models at %s: %w (give --model)", first, err)
		}
		if len(ms) == 0 {
			return nil, fmt.Errorf("%s serves no model", first)
		}
		model = ms[0]
	}
	salt := o.Salt
	if !o.SaltSet {
		salt = uint32(randUint64() % (1 << 31))
	}
	cfg := loadConfig{Workload: w.Name, Targets: o.Targets, Direct: o.Direct, Model: model, BlockSize: o.BlockSize,
		Seed: o.Seed, Salt: salt, Requests: len(w.Requests),
		Synthetic: synthCfg{Prefixes: o.Prefixes, PrefixTokens: o.PrefixTokens, TailTokens: o.TailTokens,
			OutputTokens: o.OutputTokens, Concurrency: o.Concurrency, PrefixOrder: o.PrefixOrder,
			ArrivalRate: o.ArrivalRate},
		SLO:      newSLOCfg(o.SLO),
		HitRule:  fmt.Sprintf("cached prompt tokens >= half the shared prefix (%d tokens)", w.Requests[0].HitTokens),
		TimeoutS: o.Timeout.Seconds(), Denominator: sim.Denominator,
		Notes: []string{
			"prompts are text of builtin-tokenizer words, one token each (prompt_tokens = prefix + tail exactly), sent as a string to /v1/completions with stream and stream_options.include_usage",
			"ttft_ms: request sent to the first SSE data chunk; e2e_ms: to [DONE]; cached tokens from the final usage chunk",
			"each pass uses its own salt (the direct pass salt+1), so no pass reuses the text, and so the cache entries, of another",
		}}
	if o.Direct != "" {
		if id, err := live.WorkerIdentity(ictx, hc, o.Direct); err == nil {
			cfg.DirectID = id
		}
	}
	// The reference needs the cache capacity behind the endpoints.
	if len(o.Targets) > 0 {
		if n, err := cl.Capacity(ictx, o.Targets[0], model); err == nil {
			cfg.Capacity = n
		} else {
			fmt.Fprintf(stderr, "kvbench load: warning: no worker capacity from %s/workers (%v): pooled-LRU reference left at 0\n", o.Targets[0], err)
		}
	} else if n, err := live.MockCapacity(ictx, hc, o.Direct); err == nil {
		cfg.Capacity = n
	}
	rep := &loadReport{}
	if cfg.Capacity > 0 {
		ref := sim.ComputeReference(w, cfg.Capacity)
		rep.Reference = report.Reference{PooledLRUCachedTokenRatio: ref.PooledLRU, IdealCachedTokenRatio: ref.Ideal}
	} else {
		ref := sim.ComputeReference(w, 1<<30)
		rep.Reference = report.Reference{IdealCachedTokenRatio: ref.Ideal}
	}
	passes := 0
	if len(o.Targets) > 0 {
		passes++
	}
	if o.Direct != "" {
		passes++
	}
	var done atomic.Int64 // requests finished, over every pass
	stop := progress.Start(stderr, progress.Meter{Name: "kvbench load", Unit: "requests", Total: int64(passes * len(w.Requests)), Count: done.Load},
		o.Progress.Options(stderr))
	defer stop()
	if len(o.Targets) > 0 {
		res := replay(ctx, o, w, hc, model, salt, o.Targets, &done)
		rep.Results = append(rep.Results, summarizeLive("live", w, res, o.Targets, "", o.Timeout, o.slo()))
	}
	if o.Direct != "" && ctx.Err() == nil {
		done.Store(int64((passes - 1) * len(w.Requests))) // a first pass may have stopped early (--max-duration)
		res := replay(ctx, o, w, hc, model, salt+1, []string{o.Direct}, &done)
		rep.Results = append(rep.Results, summarizeLive("direct", w, res, []string{o.Direct}, cmp.Or(cfg.DirectID, o.Direct), o.Timeout, o.slo()))
	}
	stop()
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	cfg.WallSeconds = time.Since(start).Seconds()
	rep.Config = cfg
	return rep, nil
}

// liveRequest is one request's outcome in a pass.
type liveRequest struct {
	Sent, FirstToken, Finished time.Duration // since the pass started
	Endpoint                   int
	Worker                     string
	Cached, PromptTokens       int
	HasUsage, Done, Attempted  bool
	Err                        string
}

// maxInFlight bounds an open-loop pass's requests in flight at once: past
// it the fleet is far behind its arrivals, and further sends wait (and
// count as late in their TTFT, which is measured from the arrival).
const maxInFlight = 1024

// replay runs one pass: o.Concurrency closed-loop clients, or (--arrival-
// rate) each request sent at its arrival time whether or not earlier ones
// finished; request i goes to endpoints[i mod n]. done counts the requests
// finished (for progress).
func replay(ctx context.Context, o *loadOptions, w *workload.Workload, hc *http.Client, model string, salt uint32, endpoints []string, done *atomic.Int64) []liveRequest {
	out := make([]liveRequest, len(w.Requests))
	t0 := time.Now()
	deadline := t0.Add(o.MaxDuration)
	// send runs request i; sent is when it counts as sent (its arrival,
	// in an open loop), since t0.
	send := func(i int, sent time.Duration, buf []uint32) []uint32 {
		buf = w.Tokens(i, buf)
		body := live.NewCompletionRequest(model, live.PromptText(buf, salt), w.Requests[i].OutputTokens)
		ep := i % len(endpoints)
		r := &out[i]
		r.Endpoint, r.Attempted = ep, true
		rctx, cancel := context.WithTimeout(ctx, o.Timeout)
		r.Sent = sent
		start := time.Since(t0)
		c, err := live.Complete(rctx, hc, endpoints[ep], o.keyFor(endpoints[ep]), body)
		cancel()
		done.Add(1)
		r.Finished = time.Since(t0)
		r.FirstToken = start + c.TTFT
		r.Worker, r.Cached, r.PromptTokens, r.HasUsage = c.Worker, c.CachedTokens, c.PromptTokens, c.HasUsage
		if err != nil {
			r.Err = err.Error()
			return buf
		}
		r.Done = true
		return buf
	}
	var wg sync.WaitGroup
	if w.OpenLoop {
		slots := make(chan struct{}, maxInFlight)
		for i, q := range w.Requests {
			at := t0.Add(q.At)
			if at.After(deadline) {
				break
			}
			select {
			case <-ctx.Done():
			case <-time.After(time.Until(at)):
			}
			if ctx.Err() != nil {
				break
			}
			slots <- struct{}{}
			wg.Add(1)
			go func() {
				defer wg.Done()
				send(i, q.At, nil)
				<-slots
			}()
		}
		wg.Wait()
		return out
	}
	var next atomic.Int64
	for range min(o.Concurrency, len(w.Requests)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var buf []uint32
			for ctx.Err() == nil && time.Now().Before(deadline) {
				i := int(next.Add(1) - 1)
				if i >= len(w.Requests) {
					return
				}
				buf = send(i, time.Since(t0), buf)
			}
		}()
	}
	wg.Wait()
	return out
}

// summarizeLive turns a pass into a report row with sim's math
// (sim.Summarize), so live and simulated figures mean the same: over all
// the workload's requests, a failed or unsent one a miss at the timeout
// (sim.Denominator). Per-worker and per-endpoint figures are over the
// requests sent there, failures included the same way. Requests without
// an X-Worker-Id (straight to a worker) count as worker unnamed.
func summarizeLive(policy string, w *workload.Workload, reqs []liveRequest, endpoints []string, unnamed string, timeout time.Duration, slo sim.SLO) liveResult {
	ids := map[string]int{}
	res := &sim.Result{Policy: policy, Requests: make([]sim.RequestResult, len(reqs))}
	lr := liveResult{Endpoints: endpoints}
	type acc struct {
		n, hits int
		ttft    []float64
	}
	per := map[string]*acc{}
	perEP := make([][]float64, len(endpoints))
	for i, r := range reqs {
		rr := sim.RequestResult{Worker: -1, Sent: r.Sent, FirstToken: r.FirstToken, Finished: r.Finished,
			CachedTokens: r.Cached, Done: r.Done, Err: r.Err}
		if r.Worker != "" {
			k, ok := ids[r.Worker]
			if !ok {
				k = len(ids)
				ids[r.Worker] = k
			}
			rr.Worker = k
		}
		res.Requests[i] = rr
		switch {
		case !r.Attempted:
			lr.NotSent++
		case r.Err != "" || r.Done:
			ttft := float64(timeout) / float64(time.Millisecond)
			if r.Err != "" {
				if len(lr.ErrorSamples) < 5 {
					lr.ErrorSamples = append(lr.ErrorSamples, r.Err)
				}
			} else {
				if !r.HasUsage {
					lr.NoUsage++
				} else if r.PromptTokens != w.Requests[i].PromptTokens {
					lr.PromptMismatch++
				}
				ttft = float64(r.FirstToken-r.Sent) / float64(time.Millisecond)
			}
			perEP[r.Endpoint] = append(perEP[r.Endpoint], ttft)
			name := cmp.Or(r.Worker, unnamed, "(unnamed)")
			a := per[name]
			if a == nil {
				a = &acc{}
				per[name] = a
			}
			a.n++
			a.ttft = append(a.ttft, ttft)
			if r.Done && r.Cached >= w.Requests[i].HitTokens {
				a.hits++
			}
		}
	}
	s := sim.SummarizeSLO(w, res, timeout, slo)
	s.VirtualSeconds = 0 // real time: see throughput_rps and wall time
	lr.Result = report.Median(policy, []report.Run{{Seed: w.Seed, Summary: s}})
	var wall time.Duration
	for _, r := range reqs {
		wall = max(wall, r.Finished)
	}
	lr.WallSeconds = wall.Seconds()
	names := make([]string, 0, len(per))
	for n := range per {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		a := per[n]
		lr.PerWorker = append(lr.PerWorker, workerFigures{Worker: n, Requests: a.n, HitRate: float64(a.hits) / float64(a.n),
			TTFT: stats.Of(a.ttft)})
	}
	if len(endpoints) > 1 {
		lr.PerEndpoint = map[string]float64{}
		for i, e := range endpoints {
			lr.PerEndpoint[e] = stats.Percentile(perEP[i], 50)
		}
	}
	return lr
}

// keyFor is the bearer key sent to endpoint: the worker's key to the
// --direct worker (when there is one; else the API key, as before), the
// API key to the replicas.
func (o *loadOptions) keyFor(endpoint string) string {
	if endpoint == o.Direct && o.WorkerKey != "" {
		return o.WorkerKey
	}
	return o.APIKey
}

// slo is the SLO every request is judged against.
func (o *loadOptions) slo() sim.SLO { return simSLO(o.SLO) }

// clientTLS is the TLS configuration for https endpoints: the CA named by
// --ca, or make run's CA when an endpoint is https and the file is there
// (a secure local cluster serves HTTPS with its own CA), else nil (the
// system roots).
func (o *loadOptions) clientTLS() (*tls.Config, error) {
	ca := o.CAFile
	if ca == "" && fileExists(defaultRunCA) && slices.ContainsFunc(append([]string{o.Direct}, o.Targets...), isHTTPS) {
		ca = defaultRunCA
	}
	if ca == "" {
		return nil, nil
	}
	pool, err := pki.LoadPool(ca)
	if err != nil {
		return nil, fmt.Errorf("--ca: %w", err)
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool}, nil
}

func isHTTPS(u string) bool { return strings.HasPrefix(strings.ToLower(u), "https://") }
