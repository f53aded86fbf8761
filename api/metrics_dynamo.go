package api

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// Dynamo-compatible series (--metrics-compat dynamo): the names, label
// names, units and default buckets of Dynamo's frontend
// (lib/llm/src/http/service/metrics.rs, names in
// lib/runtime/src/metrics/prometheus_names.rs) and KV router
// (lib/llm/src/kv_router/metrics.rs), exported beside the kvrouter_*
// series so Dynamo's dashboards and alerts read a kvrouter cluster
// unchanged. DESIGN.md ("Dynamo metric names") lists what is exported and
// what is not, and why.

// Metrics compatibility modes (Config.MetricsCompat).
const (
	MetricsCompatNone   = "none"
	MetricsCompatDynamo = "dynamo"
)

// Labels Dynamo's router series carry (its MetricsHierarchy adds the
// namespace and component; the router adds router_id).
const (
	dynamoNamespace = "dynamo" // Dynamo's default namespace
	dynamoComponent = "router" // prometheus_names::component_names::ROUTER
)

// dynamoLogBuckets is Dynamo's generate_log_buckets: 0, then count-1
// log-spaced values from min to max rounded to 2 significant figures,
// duplicates removed.
func dynamoLogBuckets(lo, hi float64, count int) []float64 {
	b := []float64{0}
	for i := 1; i < count; i++ {
		v := math.Exp(math.Log(lo) + (math.Log(hi)-math.Log(lo))*float64(i)/float64(count-1))
		mag := math.Floor(math.Log10(v))
		scale := math.Pow(10, 1-mag)
		v = math.Round(v*scale) / scale
		if v != b[len(b)-1] {
			b = append(b, v)
		}
	}
	return b
}

type dynamoMetrics struct {
	requests     *prometheus.CounterVec // model, endpoint, request_type, status, error_type
	inflight     *prometheus.GaugeVec
	queued       *prometheus.GaugeVec
	duration     *prometheus.HistogramVec
	isl, osl     *prometheus.HistogramVec
	cached       *prometheus.HistogramVec
	outputTokens *prometheus.CounterVec
	ttft, itl    *prometheus.HistogramVec

	routerRequests                                         prometheus.Counter
	routerTTFT, routerITL, routerISL, routerOSL, routerHit prometheus.Histogram
}

func newDynamoMetrics(reg prometheus.Registerer, rep Replica) *dynamoMetrics {
	fe := func(name string) string { return "dynamo_frontend_" + name }
	model := []string{"model"}
	var (
		durB  = dynamoLogBuckets(1, 512, 10)
		islB  = dynamoLogBuckets(50, 128000, 12)
		oslB  = dynamoLogBuckets(50, 32000, 10)
		ttftB = dynamoLogBuckets(0.001, 480, 18)
		itlB  = dynamoLogBuckets(0.001, 2, 13)
	)
	d := &dynamoMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: fe("requests_total"),
			Help: "Total number of LLM requests processed"}, []string{"model", "endpoint", "request_type", "status", "error_type"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: fe("inflight_requests"), Help: "Number of inflight requests"}, model),
		queued: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: fe("queued_requests"),
			Help: "Number of requests in HTTP processing queue"}, model),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: fe("request_duration_seconds"),
			Help: "Duration of LLM requests", Buckets: durB}, model),
		isl: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: fe("input_sequence_tokens"),
			Help: "Input sequence length in tokens", Buckets: islB}, model),
		osl: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: fe("output_sequence_tokens"),
			Help: "Output sequence length in tokens", Buckets: oslB}, model),
		cached: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: fe("cached_tokens"),
			Help: "Number of cached tokens (prefix cache hits) per request", Buckets: islB}, model),
		outputTokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: fe("output_tokens_total"),
			Help: "Total number of output tokens generated (updates in real-time)"}, model),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: fe("time_to_first_token_seconds"),
			Help: "Time to first token in seconds", Buckets: ttftB}, model),
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: fe("inter_token_latency_seconds"),
			Help: "Inter-token latency in seconds", Buckets: itlB}, model),
	}
	rl := prometheus.Labels{"dynamo_namespace": dynamoNamespace, "dynamo_component": dynamoComponent, "router_id": rep.NodeID()}
	rh := func(name, help string, b []float64) prometheus.Histogram {
		return prometheus.NewHistogram(prometheus.HistogramOpts{Name: "dynamo_component_router_" + name, Help: help, Buckets: b, ConstLabels: rl})
	}
	d.routerRequests = prometheus.NewCounter(prometheus.CounterOpts{Name: "dynamo_component_router_requests_total",
		Help: "Total number of requests processed by the router", ConstLabels: rl})
	d.routerTTFT = rh("time_to_first_token_seconds", "Time to first token observed at the router", ttftB)
	d.routerITL = rh("inter_token_latency_seconds", "Average inter-token latency observed at the router", itlB)
	d.routerISL = rh("input_sequence_tokens", "Input sequence length in tokens observed at the router", islB)
	d.routerOSL = rh("output_sequence_tokens", "Output sequence length in tokens observed at the router", oslB)
	d.routerHit = rh("kv_hit_rate", "Predicted KV cache hit rate at routing time (0.0-1.0)", prometheus.LinearBuckets(0, 0.05, 21))
	reg.MustRegister(d.requests, d.inflight, d.queued, d.duration, d.isl, d.osl, d.cached, d.outputTokens, d.ttft, d.itl,
		d.routerRequests, d.routerTTFT, d.routerITL, d.routerISL, d.routerOSL, d.routerHit, &dynamoLoadCollector{rep: rep})
	return d
}

// dynamoEndpoint is Dynamo's endpoint label for a request path.
func dynamoEndpoint(path string) string {
	switch p := strings.TrimPrefix(path, "/v1/"); p {
	case "chat/completions":
		return "chat_completions"
	case "messages":
		return "anthropic_messages"
	default:
		return strings.ReplaceAll(p, "/", "_")
	}
}

// dynamoErrorType is Dynamo's error_type label for an answer's status.
func dynamoErrorType(status int) string {
	switch {
	case status < 400:
		return ""
	case status == http.StatusNotFound:
		return "not_found"
	case status == http.StatusTooManyRequests || status == 529:
		return "overload"
	case status == http.StatusServiceUnavailable:
		return "unavailable"
	case status == http.StatusNotImplemented:
		return "not_implemented"
	case status < 500:
		return "validation"
	default:
		return "internal"
	}
}

// dynamoRequest follows one request from the proxy loop's start to its
// end for the Dynamo series. It lives in the gin context (dynamoKey) so
// relay can mark its tokens; its methods are called from the request's
// goroutine only.
type dynamoRequest struct {
	d        *dynamoMetrics
	model    string
	endpoint string
	stream   bool
	tokens   int // input tokens as routed
	start    time.Time
	queued   bool   // still counted in queued_requests
	first    bool   // a first token was seen
	outcome  string // "", "cancelled", "internal": set by relay when a started answer ends badly
	osl      int
	itlSum   float64
	itlN     int
}

const dynamoKey = "kvrouter.dynamo"

// begin starts following p; nil when compatibility is off.
func (d *dynamoMetrics) begin(p *prepared) *dynamoRequest {
	if d == nil {
		return nil
	}
	d.inflight.WithLabelValues(p.model).Inc()
	d.queued.WithLabelValues(p.model).Inc()
	return &dynamoRequest{d: d, model: p.model, endpoint: dynamoEndpoint(p.path), stream: p.stream,
		tokens: p.req.Tokens, start: p.start, queued: true}
}

func (r *dynamoRequest) dequeue() {
	if r.queued {
		r.queued = false
		r.d.queued.WithLabelValues(r.model).Dec()
	}
}

// dynamoOf is the request's Dynamo follower, nil when compatibility is
// off (every method takes a nil receiver).
func dynamoOf(c *gin.Context) *dynamoRequest {
	v, _ := c.Get(dynamoKey)
	r, _ := v.(*dynamoRequest)
	return r
}

// firstByte: the answer started (Dynamo's HTTP queue ends at the first
// response). predictedCached is the router's predicted cached tokens on
// the worker that answers, negative when there is no single prediction
// (a disaggregated plan): kv_hit_rate is observed from it.
func (r *dynamoRequest) firstByte(predictedCached int) {
	if r == nil {
		return
	}
	r.dequeue()
	if predictedCached >= 0 && r.tokens > 0 {
		r.d.routerHit.Observe(min(1, float64(predictedCached)/float64(r.tokens)))
	}
}

// broke marks a started answer that did not end well: the client went
// away (cancelled) or the worker's stream broke (internal).
func (r *dynamoRequest) broke(clientGone bool) {
	if r == nil {
		return
	}
	r.outcome = "internal"
	if clientGone {
		r.outcome = "cancelled"
	}
}

// token records n tokens that arrived at now (the first at ttft).
func (r *dynamoRequest) token(n int, ttft time.Duration, itl float64, first bool) {
	if r == nil || n <= 0 {
		return
	}
	r.d.outputTokens.WithLabelValues(r.model).Add(float64(n))
	r.osl += n
	if first {
		r.first = true
		r.d.ttft.WithLabelValues(r.model).Observe(ttft.Seconds())
		r.d.routerTTFT.Observe(ttft.Seconds())
		return
	}
	h := r.d.itl.WithLabelValues(r.model)
	for range n {
		h.Observe(itl)
	}
	r.itlSum += itl * float64(n)
	r.itlN += n
}

// usage records the worker's reported usage at the end of an answer.
func (r *dynamoRequest) usage(u usage) {
	if r == nil {
		return
	}
	if u.CompletionTokens > r.osl { // a non-streamed answer, or tokens the stream did not show one by one
		r.d.outputTokens.WithLabelValues(r.model).Add(float64(u.CompletionTokens - r.osl))
		r.osl = u.CompletionTokens
	}
	if u.Details != nil {
		r.d.cached.WithLabelValues(r.model).Observe(float64(u.Details.CachedTokens))
	}
}

// end closes the request with the status the client got; gone: the
// client left before any answer.
func (r *dynamoRequest) end(status int, gone bool) {
	if r == nil {
		return
	}
	if gone && r.outcome == "" {
		r.outcome = "cancelled"
	}
	r.dequeue()
	r.d.inflight.WithLabelValues(r.model).Dec()
	reqType := "unary"
	if r.stream {
		reqType = "stream"
	}
	st, et := "success", dynamoErrorType(status)
	if r.outcome != "" {
		et = r.outcome
	}
	if et != "" {
		st = "error"
	}
	r.d.requests.WithLabelValues(r.model, r.endpoint, reqType, st, et).Inc()
	r.d.duration.WithLabelValues(r.model).Observe(time.Since(r.start).Seconds())
	if st != "success" {
		return
	}
	r.d.isl.WithLabelValues(r.model).Observe(float64(r.tokens))
	r.d.osl.WithLabelValues(r.model).Observe(float64(r.osl))
	r.d.routerRequests.Inc()
	r.d.routerISL.Observe(float64(r.tokens))
	r.d.routerOSL.Observe(float64(r.osl))
	if r.itlN > 0 {
		r.d.routerITL.Observe(r.itlSum / float64(r.itlN))
	}
}

// dynamoLoadCollector reports Dynamo's per-worker load gauges at scrape
// time from the routers, as loadCollector does ours. worker_type is
// "prefill" for a disaggregated model's prefill stage and "decode" for
// its decode stage and for aggregated workers; dp_rank is the rank a
// worker stands for (0 when its engine runs one).
type dynamoLoadCollector struct{ rep Replica }

var (
	descDynDecode  = prometheus.NewDesc("dynamo_frontend_worker_active_decode_blocks", "Active KV cache decode blocks per worker", []string{"worker_id", "dp_rank", "worker_type"}, nil)
	descDynPrefill = prometheus.NewDesc("dynamo_frontend_worker_active_prefill_tokens", "Active prefill tokens queued per worker", []string{"worker_id", "dp_rank", "worker_type"}, nil)
	descDynBlock   = prometheus.NewDesc("dynamo_frontend_model_kv_cache_block_size", "KV cache block size in tokens for a worker serving the model", []string{"model"}, nil)
)

func (l *dynamoLoadCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descDynDecode
	ch <- descDynPrefill
	ch <- descDynBlock
}

func (l *dynamoLoadCollector) Collect(ch chan<- prometheus.Metric) {
	type key struct{ id, kind string }
	seen := map[key]bool{} // a worker serving two models is one series, as in Dynamo
	for _, model := range l.rep.Models() {
		rt, ok := l.rep.Router(model)
		if !ok {
			continue
		}
		ch <- prometheus.MustNewConstMetric(descDynBlock, prometheus.GaugeValue, float64(rt.Config().BlockSize), model)
		stages := map[string]*router.Router{"decode": rt}
		if dr, ok := l.rep.(DisaggReplica); ok {
			if d, ok := dr.Disagg(model); ok {
				pr, dc := d.Routers()
				stages = map[string]*router.Router{"prefill": pr, "decode": dc}
			}
		}
		for kind, r := range stages {
			for _, w := range r.Workers() {
				k := key{string(w.ID), kind}
				if seen[k] {
					continue
				}
				seen[k] = true
				rank := "0"
				if n, ok := l.rep.DPRank(w.ID); ok {
					rank = strconv.Itoa(n)
				}
				ld := r.Load().Load(w.ID)
				ch <- prometheus.MustNewConstMetric(descDynDecode, prometheus.GaugeValue, float64(ld.ActiveBlocks), string(w.ID), rank, kind)
				ch <- prometheus.MustNewConstMetric(descDynPrefill, prometheus.GaugeValue, float64(ld.ActivePrefillTokens), string(w.ID), rank, kind)
			}
		}
	}
}
