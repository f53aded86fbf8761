package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/internal/poll"
)

// checkFor is internal/poll.Until, the one deadline-polling helper of every
// test package (docs/STYLE.md, Tests), under the name this package's tests
// call it by.
var checkFor = poll.Until

// testLog is a logger into t.Log that goes quiet once the test is over.
func testLog(t *testing.T) *slog.Logger {
	w := &tWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct {
	mu   sync.Mutex
	t    *testing.T
	done bool
}

func (w *tWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimRight(string(p), "\n"))
	}
	return len(p), nil
}

// fakePublisher records events the way eventbus.Publisher numbers them,
// round-tripping each through the wire encoding.
type fakePublisher struct {
	worker string
	dpRank uint32

	mu        sync.Mutex
	next      uint64
	events    []eventbus.WireEvent
	failFirst int // PublishAsync refuses this many calls
	calls     int
	flushes   int
	closed    bool
}

func newFakePublisher(worker string) *fakePublisher { return &fakePublisher{worker: worker, next: 1} }

func (f *fakePublisher) PublishAsync(_ context.Context, ev eventbus.WireEvent) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return 0, eventbus.ErrPublisherClosed
	}
	f.calls++
	if f.calls <= f.failFirst {
		return 0, errors.New("nats: connection closed (test)")
	}
	ev.Worker, ev.DPRank = f.worker, f.dpRank
	if ev.EventID == 0 {
		ev.EventID = f.next
	}
	if err := eventbus.Validate(&ev, 0); err != nil {
		return 0, err
	}
	data, err := eventbus.Encode(&ev)
	if err != nil {
		return 0, err
	}
	back, err := eventbus.Decode(data)
	if err != nil {
		return 0, err
	}
	f.next = ev.EventID + 1
	f.events = append(f.events, back)
	return ev.EventID, nil
}

func (f *fakePublisher) NextEventID() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.next
}

func (f *fakePublisher) Flush(context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.flushes++
	return nil
}

func (f *fakePublisher) Stats() eventbus.PublisherStats {
	f.mu.Lock()
	defer f.mu.Unlock()
	return eventbus.PublisherStats{Published: uint64(len(f.events)), Acked: uint64(len(f.events))}
}

func (f *fakePublisher) Close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
}

func (f *fakePublisher) snapshot() []eventbus.WireEvent {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]eventbus.WireEvent(nil), f.events...)
}

// testMock is a running kvmock with a fake publisher.
type testMock struct {
	m   *Mock
	url string
	pub *fakePublisher
	// rankPubs are the other data-parallel ranks' publishers (--dp-ranks),
	// rankPubs[r-1] for rank r.
	rankPubs []*fakePublisher
	hooks    chan busHooks // receives the hooks when the bus "connects"
	// ln, if a before option sets it, is served instead of a new TCP
	// listener on 127.0.0.1 (memNet.serveOn).
	ln   net.Listener
	stop func() // graceful shutdown, waits for Serve
}

// testConfig is the default configuration, made fast for tests.
func testConfig(t *testing.T) config {
	t.Helper()
	cfg, err := parseConfig(nil, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	cfg.KVBlocks = 512
	cfg.Speedup = 20
	cfg.ShutdownTimeout = 5 * time.Second
	return cfg
}

// startMock runs a kvmock; mutate adjusts its configuration, before
// adjusts the test mock before it starts. The fake publisher is used unless
// noBus.
func startMock(t *testing.T, mutate func(*config), noBus bool, before ...func(*testMock)) *testMock {
	t.Helper()
	cfg := testConfig(t)
	if mutate != nil {
		mutate(&cfg)
	}
	tm := &testMock{pub: newFakePublisher(cfg.ID), hooks: make(chan busHooks, 1)}
	for r := 1; r < cfg.DPRanks; r++ {
		p := newFakePublisher(cfg.ID)
		p.dpRank = uint32(r)
		tm.rankPubs = append(tm.rankPubs, p)
	}
	var connect connectFunc
	if !noBus {
		connect = func(_ context.Context, worker string, dpRank uint32, hooks busHooks) (Publisher, func(), error) {
			if worker != cfg.ID {
				t.Errorf("connect for worker %q, want %q", worker, cfg.ID)
			}
			if dpRank != 0 {
				if int(dpRank) > len(tm.rankPubs) {
					t.Errorf("connect for rank %d of %d", dpRank, cfg.DPRanks)
					return nil, nil, errors.New("no such rank")
				}
				p := tm.rankPubs[dpRank-1]
				p.mu.Lock()
				p.next = hooks.firstEventID
				p.mu.Unlock()
				return p, func() {}, nil
			}
			tm.pub.mu.Lock()
			tm.pub.next = hooks.firstEventID
			tm.pub.mu.Unlock()
			tm.hooks <- hooks
			return tm.pub, func() {}, nil
		}
	}
	m, err := newMock(cfg, testLog(t), connect)
	if err != nil {
		t.Fatal(err)
	}
	tm.m = m
	for _, fn := range before {
		fn(tm)
	}
	ln := tm.ln
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Serve(ctx, ln) }()
	tm.m, tm.url = m, "http://"+ln.Addr().String()
	var once sync.Once
	tm.stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Serve: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("Serve did not return")
			}
		})
	}
	t.Cleanup(tm.stop)
	return tm
}

// post sends a JSON body and returns the status and body.
func post(t *testing.T, url string, body any) (int, []byte) {
	t.Helper()
	return postWith(t, http.DefaultClient, url, body)
}

// postWith is post with client c.
func postWith(t *testing.T, c *http.Client, url string, body any) (int, []byte) {
	t.Helper()
	data, ok := body.([]byte)
	if !ok {
		var err error
		if data, err = json.Marshal(body); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := c.Post(url, "application/json", bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, out
}

func get(t *testing.T, url string) (int, []byte) {
	t.Helper()
	return getWith(t, http.DefaultClient, url)
}

// getWith is get with client c.
func getWith(t *testing.T, c *http.Client, url string) (int, []byte) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, out
}

// answer is the OpenAI response fields the tests read.
type answer struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int `json:"index"`
		Message *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		Text         *string `json:"text"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		TotalTokens         int `json:"total_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func decodeAnswer(t *testing.T, body []byte) answer {
	t.Helper()
	var a answer
	if err := json.Unmarshal(body, &a); err != nil {
		t.Fatalf("decode %s: %v", body, err)
	}
	return a
}

// readSSE reads every data line of a stream; done says [DONE] came last.
func readSSE(t *testing.T, r io.Reader) (chunks []answer, done bool) {
	t.Helper()
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("not an SSE data line: %q", line)
		}
		if done {
			t.Fatalf("data after [DONE]: %q", line)
		}
		if data == "[DONE]" {
			done = true
			continue
		}
		chunks = append(chunks, decodeAnswer(t, []byte(data)))
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return chunks, done
}

func postStream(t *testing.T, url string, body any) (*http.Response, []answer, bool) {
	t.Helper()
	data, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("stream: HTTP %d: %s", resp.StatusCode, b)
	}
	chunks, done := readSSE(t, resp.Body)
	return resp, chunks, done
}
