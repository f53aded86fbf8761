package api

import (
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/router"
)

func TestMetricsTokenScanner(t *testing.T) {
	for _, tc := range []struct {
		name   string
		writes []string
		want   []int // tokens returned by each write
	}{
		{"role-only first chunk", []string{`data: {"choices":[{"delta":{"role":"assistant"}}]}` + "\n\n"}, []int{0}},
		{"empty content", []string{`data: {"choices":[{"delta":{"role":"assistant","content":""}}]}` + "\n\n"}, []int{0}},
		{"content", []string{`data: {"choices":[{"delta":{"content":"Hi"}}]}` + "\n\n"}, []int{1}},
		{"completions text", []string{`data: {"choices":[{"text":" once"}]}` + "\n\n"}, []int{1}},
		{"empty text", []string{`data: {"choices":[{"text":""}]}` + "\n\n"}, []int{0}},
		{"tool call", []string{`data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}}]}}]}` + "\n\n"}, []int{1}},
		{"reasoning", []string{`data: {"choices":[{"delta":{"reasoning_content":"hm"}}]}` + "\n\n"}, []int{1}},
		{"done", []string{"data: [DONE]\n\n"}, []int{0}},
		{"usage-only final chunk", []string{`data: {"choices":[],"usage":{"completion_tokens":7}}` + "\n\n"}, []int{0}},
		{"not json", []string{"data: hello\n\n", ": keep-alive\n\n", "event: ping\n"}, []int{0, 0, 0}},
		{"split across reads", []string{`data: {"choices":[{"del`, `ta":{"content":"x"}}]}`, "\n\n"}, []int{0, 0, 1}},
		{"several events in one read", []string{`data: {"choices":[{"delta":{"content":"a"}}]}` + "\n\n" +
			`data: {"choices":[{"delta":{"content":"b"}}]}` + "\n\n"}, []int{2}},
		{"continuous usage counts tokens", []string{
			`data: {"choices":[{"delta":{"content":"ab"}}],"usage":{"completion_tokens":2}}` + "\n\n",
			`data: {"choices":[{"delta":{"content":"cde"}}],"usage":{"completion_tokens":5}}` + "\n\n",
			`data: {"choices":[],"usage":{"completion_tokens":5}}` + "\n\n"}, []int{2, 3, 0}},
		{"CRLF lines", []string{"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\n\r\n"}, []int{1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s tokenScanner
			for i, w := range tc.writes {
				if got := s.write([]byte(w)); got != tc.want[i] {
					t.Errorf("write %d (%q) = %d tokens, want %d", i, w, got, tc.want[i])
				}
			}
		})
	}
}

func TestMetricsDynamoBuckets(t *testing.T) {
	// Dynamo's generate_log_buckets(0.001, 2.0, 13): 0, then 12 values
	// from 0.001·r to 2 (the minimum itself is never a bound).
	want := []float64{0, 0.0019, 0.0035, 0.0067, 0.013, 0.024, 0.045, 0.084, 0.16, 0.3, 0.56, 1.1, 2}
	if got := dynamoLogBuckets(0.001, 2, 13); !slices.Equal(got, want) {
		t.Errorf("ITL buckets %v, want %v", got, want)
	}
	if b := dynamoLogBuckets(1, 512, 10); b[len(b)-1] != 510 {
		t.Errorf("duration buckets %v (Dynamo rounds 512 to 2 significant figures: 510)", b)
	}
}

// dynamoServer is a test server with --metrics-compat dynamo that has
// served one plain and one streamed chat request.
func dynamoServer(t *testing.T, compat string) *Server {
	t.Helper()
	rep := newFakeReplica("m", router.DefaultConfig())
	w := fakeWorker(t, new(atomic.Int64))
	rep.addWorker("m", "w1", w.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), Retries: 2, AllowLoopbackWorkers: true, MetricsCompat: compat}, rep)
	for _, extra := range []string{"", `,"stream":true`} {
		if rec := do(s, "POST", "/v1/chat/completions", fmt.Sprintf(chatBody, extra)); rec.Code != 200 {
			t.Fatalf("request: %d %s", rec.Code, rec.Body)
		}
	}
	return s
}

func TestMetricsDynamoNames(t *testing.T) {
	s := dynamoServer(t, MetricsCompatDynamo)
	fams, err := s.cfg.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		byName[f.GetName()] = f
	}
	labels := func(m *dto.Metric) []string {
		var out []string
		for _, l := range m.GetLabel() {
			out = append(out, l.GetName())
		}
		return out
	}
	router := []string{"dynamo_component", "dynamo_namespace", "router_id"}
	want := map[string][]string{ // name → label names (sorted, as gathered)
		"dynamo_frontend_requests_total":                      {"endpoint", "error_type", "model", "request_type", "status"},
		"dynamo_frontend_inflight_requests":                   {"model"},
		"dynamo_frontend_queued_requests":                     {"model"},
		"dynamo_frontend_request_duration_seconds":            {"model"},
		"dynamo_frontend_input_sequence_tokens":               {"model"},
		"dynamo_frontend_output_sequence_tokens":              {"model"},
		"dynamo_frontend_cached_tokens":                       {"model"},
		"dynamo_frontend_output_tokens_total":                 {"model"},
		"dynamo_frontend_time_to_first_token_seconds":         {"model"},
		"dynamo_frontend_worker_active_decode_blocks":         {"dp_rank", "worker_id", "worker_type"},
		"dynamo_frontend_worker_active_prefill_tokens":        {"dp_rank", "worker_id", "worker_type"},
		"dynamo_frontend_model_kv_cache_block_size":           {"model"},
		"dynamo_component_router_requests_total":              router,
		"dynamo_component_router_time_to_first_token_seconds": router,
		"dynamo_component_router_input_sequence_tokens":       router,
		"dynamo_component_router_output_sequence_tokens":      router,
		"dynamo_component_router_kv_hit_rate":                 router,
	}
	for name, ls := range want {
		f, ok := byName[name]
		if !ok || len(f.GetMetric()) == 0 {
			t.Errorf("%s missing from /metrics", name)
			continue
		}
		if got := labels(f.GetMetric()[0]); !slices.Equal(got, ls) {
			t.Errorf("%s labels %v, want %v", name, got, ls)
		}
	}
	// Two requests, one of each type; TTFT only for the streamed one.
	for _, typ := range []string{"unary", "stream"} {
		found := false
		for _, m := range byName["dynamo_frontend_requests_total"].GetMetric() {
			if slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool { return l.GetName() == "request_type" && l.GetValue() == typ }) {
				found = m.GetCounter().GetValue() == 1
			}
		}
		if !found {
			t.Errorf("no %s request counted", typ)
		}
	}
	if n := byName["dynamo_frontend_time_to_first_token_seconds"].GetMetric()[0].GetHistogram().GetSampleCount(); n != 1 {
		t.Errorf("dynamo TTFT observed %d times, want 1 (the streamed answer only)", n)
	}
	if n := byName["kvrouter_ttft_seconds"].GetMetric()[0].GetHistogram().GetSampleCount(); n != 1 {
		t.Errorf("kvrouter TTFT observed %d times, want 1 (the streamed answer only)", n)
	}
	// Plain answer: usage says 1; the stream: 3 content chunks (usage 3).
	if v := byName["dynamo_frontend_output_tokens_total"].GetMetric()[0].GetCounter().GetValue(); v != 4 {
		t.Errorf("output tokens %v, want 4", v)
	}
	for _, g := range []string{"dynamo_frontend_inflight_requests", "dynamo_frontend_queued_requests"} {
		if v := byName[g].GetMetric()[0].GetGauge().GetValue(); v != 0 {
			t.Errorf("%s = %v after all requests ended", g, v)
		}
	}
}

func TestMetricsDynamoOffByDefault(t *testing.T) {
	s := dynamoServer(t, "")
	rec := do(s, "GET", "/metrics", "")
	if strings.Contains(rec.Body.String(), "dynamo_") {
		t.Errorf("Dynamo names exported without --metrics-compat dynamo")
	}
}

// TestMetricsPromtoolCheck runs Prometheus's own linter (Debian's
// prometheus package ships promtool; .ci/run installs it) over /metrics
// with the Dynamo names on.
func TestMetricsPromtoolCheck(t *testing.T) {
	bin, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not installed (apt-get install prometheus): skipping `promtool check metrics`")
	}
	s := dynamoServer(t, MetricsCompatDynamo)
	rec := do(s, "GET", "/metrics", "")
	cmd := exec.Command(bin, "check", "metrics")
	cmd.Stdin = strings.NewReader(rec.Body.String())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}

// TestMetricsTokenTiming: the first tokens give TTFT (their companions are
// not timed again), later tokens one ITL observation each, the gap shared
// among the tokens that arrived together.
func TestMetricsTokenTiming(t *testing.T) {
	m := newMetrics(prometheus.NewRegistry(), newFakeReplica("x", router.DefaultConfig()), MetricsCompatDynamo)
	start := time.Now()
	p := &prepared{model: "x", start: start}
	dyn := m.dynamo.begin(p)
	var last time.Time
	m.observeTokens(p, dyn, 0, start.Add(time.Second), &last) // a role-only chunk: nothing
	m.observeTokens(p, dyn, 2, start.Add(2*time.Second), &last)
	m.observeTokens(p, dyn, 4, start.Add(3*time.Second), &last)
	ttft := m.ttft.WithLabelValues("x").(prometheus.Histogram)
	itl := m.itl.WithLabelValues("x").(prometheus.Histogram)
	if c, sum := histCount(t, ttft); c != 1 || sum != 2 {
		t.Errorf("TTFT count %d sum %v, want 1 and 2 s", c, sum)
	}
	if c, sum := histCount(t, itl); c != 4 || sum != 1 {
		t.Errorf("ITL count %d sum %v, want 4 observations of 0.25 s", c, sum)
	}
	if c, _ := histCount(t, m.dynamo.itl.WithLabelValues("x").(prometheus.Histogram)); c != 4 {
		t.Errorf("dynamo ITL count %d, want 4", c)
	}
	dyn.end(200, false)
	if c, sum := histCount(t, m.dynamo.routerITL); c != 1 || sum != 0.25 {
		t.Errorf("router ITL (per-request average) count %d sum %v", c, sum)
	}
}

func histCount(t *testing.T, h prometheus.Histogram) (uint64, float64) {
	t.Helper()
	var m dto.Metric
	if err := h.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
}
