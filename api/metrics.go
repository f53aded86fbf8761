package api

import (
	"bytes"
	"encoding/json"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/router"
)

// metrics are the HTTP layer's Prometheus series, on the replica's own
// registry (no globals: three replicas can share a test process).
type metrics struct {
	requests        *prometheus.CounterVec
	routed          *prometheus.CounterVec
	rejected        *prometheus.CounterVec
	retries         *prometheus.CounterVec
	workerFailures  *prometheus.CounterVec
	ttft            *prometheus.HistogramVec
	itl             *prometheus.HistogramVec
	e2e             *prometheus.HistogramVec
	inputTokens     *prometheus.CounterVec
	outputTokens    *prometheus.CounterVec
	promptTokens    *prometheus.CounterVec
	engineCached    *prometheus.CounterVec
	predictedCached *prometheus.CounterVec
	queued          *prometheus.GaugeVec
	noTokenizer     *prometheus.CounterVec

	disaggDecisions  *prometheus.CounterVec
	disaggEstimate   *prometheus.HistogramVec
	disaggRecoveries *prometheus.CounterVec

	dynamo *dynamoMetrics // nil unless --metrics-compat dynamo
}

func newMetrics(reg prometheus.Registerer, rep Replica, compat string) *metrics {
	latency := []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_requests_total",
			Help: "Inference requests answered, by model and outcome (HTTP status or client_gone/upstream_error)."}, []string{"model", "status"}),
		routed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_routed_total",
			Help: "Routing decisions, by model and chosen worker."}, []string{"model", "worker"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_rejected_requests_total",
			Help: "Requests refused before reaching a worker, by reason."}, []string{"reason"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_worker_retries_total",
			Help: "Requests retried on another worker after this one failed before it could start work (connect error, 503/529 answer)."}, []string{"worker"}),
		workerFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_worker_failures_total",
			Help: "Failed attempts on a worker, by failure: connect (request not delivered), unavailable (503/529 answer), dropped (connection lost after the request was sent: never retried), no_address."}, []string{"worker", "failure"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvrouter_ttft_seconds",
			Help: "Time from request arrival to the first generated token of a streamed answer (the first SSE event with content, reasoning or a tool call); non-streamed answers are not observed (see kvrouter_request_duration_seconds).", Buckets: latency}, []string{"model"}),
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvrouter_itl_seconds",
			Help: "Time per generated token after the first in a streamed answer: the gap since the previous tokens divided by the tokens that arrived, observed once per token.", Buckets: latency}, []string{"model"}),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvrouter_request_duration_seconds",
			Help: "Time from request arrival to the end of the answer.", Buckets: latency}, []string{"model"}),
		inputTokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_input_tokens_total",
			Help: "Prompt tokens as the router tokenized them."}, []string{"model"}),
		outputTokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_output_tokens_total",
			Help: "Completion tokens as the workers reported them."}, []string{"model"}),
		promptTokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_worker_prompt_tokens_total",
			Help: "Prompt tokens as the workers reported them."}, []string{"worker"}),
		engineCached: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_worker_cached_tokens_total",
			Help: "Cached prompt tokens as the workers reported them (usage.prompt_tokens_details.cached_tokens)."}, []string{"worker"}),
		predictedCached: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_predicted_cached_tokens_total",
			Help: "Cached prompt tokens the router predicted from its index, for requests whose usage the worker reported; compare with kvrouter_worker_cached_tokens_total."}, []string{"worker"}),
		queued: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_queue_depth",
			Help: "Requests waiting for a worker below the queue threshold."}, []string{"model"}),
	}
	m.noTokenizer = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_requests_without_tokenizer_total",
		Help: "Requests for a model this replica has no tokenizer files for: routed by load only, never a prefix hit (start the replica with --model-dir NAME=DIR)."},
		[]string{"model"})
	m.disaggDecisions = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_disagg_decisions_total",
		Help: "Two-stage routing decisions, by model, mode and outcome (disaggregated, aggregated, fallback: the mode wanted disaggregation and could not)."},
		[]string{"model", "mode", "outcome"})
	m.disaggEstimate = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvrouter_disagg_estimated_ttft_seconds",
		Help:    "The planner's TTFT estimate per request for each way of serving it (aggregated, disaggregated), whichever was chosen.",
		Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}}, []string{"model", "path"})
	m.disaggRecoveries = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_disagg_recoveries_total",
		Help: "Disaggregated requests whose prefill or KV transfer failed, by action (retry-transfer, aggregate)."},
		[]string{"model", "action"})
	reg.MustRegister(m.requests, m.routed, m.rejected, m.retries, m.workerFailures, m.ttft, m.itl, m.e2e, m.inputTokens,
		m.outputTokens, m.promptTokens, m.engineCached, m.predictedCached, m.queued, &loadCollector{rep: rep},
		m.disaggDecisions, m.disaggEstimate, m.disaggRecoveries, &disaggCollector{rep: rep}, m.noTokenizer)
	if compat == MetricsCompatDynamo {
		m.dynamo = newDynamoMetrics(reg, rep)
	}
	return m
}

func (m *metrics) observePlan(model string, p router.DisaggPlan) {
	outcome := "aggregated"
	switch {
	case p.Disaggregated:
		outcome = "disaggregated"
	case p.Fallback:
		outcome = "fallback"
	}
	m.disaggDecisions.WithLabelValues(model, string(p.Mode), outcome).Inc()
	m.disaggEstimate.WithLabelValues(model, "aggregated").Observe(p.Agg.Total.Seconds())
	if p.DisaggOK {
		m.disaggEstimate.WithLabelValues(model, "disaggregated").Observe(p.Disagg.Total.Seconds())
	}
}

func (m *metrics) observeUsage(model, worker string, u usage, predicted int) {
	m.outputTokens.WithLabelValues(model).Add(float64(u.CompletionTokens))
	m.promptTokens.WithLabelValues(worker).Add(float64(u.PromptTokens))
	if u.Details != nil {
		m.engineCached.WithLabelValues(worker).Add(float64(u.Details.CachedTokens))
		m.predictedCached.WithLabelValues(worker).Add(float64(predicted))
	}
}

// loadCollector reports every worker's load at scrape time, read from the
// routers, so the gauges never go stale.
type loadCollector struct{ rep Replica }

var (
	descDecode  = prometheus.NewDesc("kvrouter_worker_active_decode_blocks", "KV blocks held by in-flight requests on the worker, as this replica sees it (all replicas' requests).", []string{"model", "worker"}, nil)
	descPrefill = prometheus.NewDesc("kvrouter_worker_active_prefill_tokens", "Prompt tokens still to prefill on the worker, as this replica sees it.", []string{"model", "worker"}, nil)
	descInfl    = prometheus.NewDesc("kvrouter_worker_inflight_requests", "In-flight requests on the worker, as this replica sees it.", []string{"model", "worker"}, nil)
)

func (l *loadCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descDecode
	ch <- descPrefill
	ch <- descInfl
}

func (l *loadCollector) Collect(ch chan<- prometheus.Metric) {
	for _, model := range l.rep.Models() {
		rt, ok := l.rep.Router(model)
		if !ok {
			continue
		}
		routers := []*router.Router{rt}
		if dr, ok := l.rep.(DisaggReplica); ok {
			if d, ok := dr.Disagg(model); ok {
				// A disaggregated model's load is in its two stage routers
				// (a "both" worker can carry load in each): report the sum.
				pr, dc := d.Routers()
				routers = []*router.Router{pr, dc}
			}
		}
		sums := map[router.WorkerID]*router.WorkerLoad{}
		var order []router.WorkerID
		for _, r := range routers {
			for _, w := range r.Workers() {
				ld := r.Load().Load(w.ID)
				if s, ok := sums[w.ID]; ok {
					s.ActiveBlocks += ld.ActiveBlocks
					s.ActivePrefillTokens += ld.ActivePrefillTokens
					s.Requests += ld.Requests
					continue
				}
				sums[w.ID] = &ld
				order = append(order, w.ID)
			}
		}
		for _, id := range order {
			ld := sums[id]
			ch <- prometheus.MustNewConstMetric(descDecode, prometheus.GaugeValue, float64(ld.ActiveBlocks), model, string(id))
			ch <- prometheus.MustNewConstMetric(descPrefill, prometheus.GaugeValue, float64(ld.ActivePrefillTokens), model, string(id))
			ch <- prometheus.MustNewConstMetric(descInfl, prometheus.GaugeValue, float64(ld.Requests), model, string(id))
		}
	}
}

// disaggCollector reports each disaggregated model's transfer figures from
// its router: observed against estimated transfer time tells an operator
// whether --disagg-link-mbps describes the real link.
type disaggCollector struct{ rep Replica }

var (
	descXfers     = prometheus.NewDesc("kvrouter_disagg_transfers_total", "KV transfers completed (prefill done → decode worker's first byte).", []string{"model"}, nil)
	descXferBytes = prometheus.NewDesc("kvrouter_disagg_transfer_bytes_total", "KV bytes moved by completed transfers, as planned (uncached tokens × bytes per token).", []string{"model"}, nil)
	descXferSecs  = prometheus.NewDesc("kvrouter_disagg_transfer_seconds_total", "Observed time of completed transfers (prefill done → decode worker's first byte, so its first step included).", []string{"model"}, nil)
	descXferEst   = prometheus.NewDesc("kvrouter_disagg_transfer_estimated_seconds_total", "The planner's estimate of the same transfers' time; compare with kvrouter_disagg_transfer_seconds_total.", []string{"model"}, nil)
	descXferInfl  = prometheus.NewDesc("kvrouter_disagg_transfers_in_flight", "Requests between prefill done and the decode worker's first byte.", []string{"model"}, nil)
)

func (d *disaggCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, x := range []*prometheus.Desc{descXfers, descXferBytes, descXferSecs, descXferEst, descXferInfl} {
		ch <- x
	}
}

func (d *disaggCollector) Collect(ch chan<- prometheus.Metric) {
	dr, ok := d.rep.(DisaggReplica)
	if !ok {
		return
	}
	for _, model := range d.rep.Models() {
		r, ok := dr.Disagg(model)
		if !ok {
			continue
		}
		st := r.Stats()
		ch <- prometheus.MustNewConstMetric(descXfers, prometheus.CounterValue, float64(st.Transfers), model)
		ch <- prometheus.MustNewConstMetric(descXferBytes, prometheus.CounterValue, float64(st.TransferBytes), model)
		ch <- prometheus.MustNewConstMetric(descXferSecs, prometheus.CounterValue, st.TransferSeconds, model)
		ch <- prometheus.MustNewConstMetric(descXferEst, prometheus.CounterValue, st.TransferEstimateSeconds, model)
		ch <- prometheus.MustNewConstMetric(descXferInfl, prometheus.GaugeValue, float64(st.InFlightTransfers), model)
	}
}

// tokenScanner finds the generated tokens in a streamed (SSE) answer as
// the relay passes it on, so TTFT and ITL are taken at tokens rather than
// at bytes (DESIGN.md, "Token timing"). An SSE data event carries
// generated output when one of its choices has non-empty delta.content,
// delta.reasoning_content / delta.reasoning, delta.tool_calls (chat) or
// text (completions); a role-only first chunk, an empty content, a
// usage-only final chunk and [DONE] carry none. Such an event stands for
// one token, unless it reports usage (vLLM's continuous_usage_stats):
// then for the growth of usage.completion_tokens since the last event
// that reported it, Dynamo's "tokens per response".
type tokenScanner struct {
	pending   []byte // the unfinished line
	lastUsage int    // the last cumulative completion_tokens seen
	tokens    int    // tokens counted so far
}

// sseChunk is the part of a streamed chunk the scanner reads.
type sseChunk struct {
	Choices []struct {
		Delta *struct {
			Content          string            `json:"content"`
			ReasoningContent string            `json:"reasoning_content"`
			Reasoning        string            `json:"reasoning"`
			ToolCalls        []json.RawMessage `json:"tool_calls"`
		} `json:"delta"`
		Text string `json:"text"`
	} `json:"choices"`
	Usage *struct {
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

// write consumes relayed bytes and returns the tokens the complete events
// among them carry (0: none, the bytes were not a token).
func (t *tokenScanner) write(b []byte) int {
	t.pending = append(t.pending, b...)
	n := 0
	for {
		i := bytes.IndexByte(t.pending, '\n')
		if i < 0 {
			break
		}
		line := bytes.TrimSpace(t.pending[:i])
		t.pending = t.pending[i+1:]
		if data, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			n += t.event(bytes.TrimSpace(data))
		}
	}
	if len(t.pending) > maxAuditBody { // not SSE: stop buffering
		t.pending = t.pending[:0]
	}
	if len(t.pending) == 0 && cap(t.pending) > 64<<10 {
		t.pending = nil
	}
	t.tokens += n
	return n
}

// event returns the tokens one SSE data event carries.
func (t *tokenScanner) event(data []byte) int {
	if len(data) == 0 || data[0] != '{' { // [DONE] or not JSON
		return 0
	}
	e, ok := scanSSEChunk(data) // ssescan.go: without encoding/json when it can vouch
	if !ok {
		if e, ok = decodeSSEChunk(data); !ok {
			return 0
		}
	}
	content := e.content
	if !e.hasUsage {
		return content
	}
	grown := e.completionTokens - t.lastUsage
	t.lastUsage = e.completionTokens
	if content == 0 {
		return 0 // the usage-only final chunk: no token arrived now
	}
	return max(grown, content)
}

// observeTokens times k tokens of a streamed answer that arrived at now
// (k 0: nothing to time). The first tokens' arrival is the TTFT (tokens
// that came with the first are not timed again, as in Dynamo); each later
// token gets the gap since the previous tokens divided by k, so the ITL
// histogram has one observation per token.
func (m *metrics) observeTokens(p *prepared, dyn *dynamoRequest, k int, now time.Time, last *time.Time) {
	if k <= 0 {
		return
	}
	if last.IsZero() {
		ttft := now.Sub(p.start)
		m.ttft.WithLabelValues(p.model).Observe(ttft.Seconds())
		dyn.token(k, ttft, 0, true)
	} else {
		itl := now.Sub(*last).Seconds() / float64(k)
		h := m.itl.WithLabelValues(p.model)
		for range k {
			h.Observe(itl)
		}
		dyn.token(k, 0, itl, false)
	}
	*last = now
}
