package zmqbridge

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/eventbus"
	"github.com/kvrouter/kvrouter/eventbus/registrar"
	"github.com/kvrouter/kvrouter/internal/poll"
	"github.com/kvrouter/kvrouter/router"
)

// fakeEngine speaks an engine's real KV event protocol over ZMQ: a PUB
// socket sending [topic, seq8, payload] and a ROUTER replay socket that
// answers ["", seq8] with every buffered batch from there on and an end
// marker, in vLLM's newer reply format (with the topic frame) or the older
// one (SGLang's, without). It also serves the HTTP surface the bridge
// reads: /v1/models, /metrics and a minimal /v1/chat/completions.
type fakeEngine struct {
	t         *testing.T
	topic     string
	newReplay bool
	model     string
	blocks    int // num_gpu_blocks reported
	blockSize int // block_size reported

	mu       sync.Mutex
	ctx      context.Context
	cancel   context.CancelFunc
	pub      zmq4.Socket
	rtr      zmq4.Socket
	pubAddr  string
	rtrAddr  string
	seq      uint64
	buffer   []Frame
	bufMax   int
	requests []uint64
	errs     []error
	http     *httptest.Server
	done     chan struct{}
}

type engineOpts struct {
	topic     string
	newReplay bool
	model     string
	blocks    int
	blockSize int
	bufMax    int
}

func startFakeEngine(t *testing.T, o engineOpts) *fakeEngine {
	if o.bufMax == 0 {
		o.bufMax = 10000
	}
	if o.blockSize == 0 {
		o.blockSize = 16
	}
	e := &fakeEngine{t: t, topic: o.topic, newReplay: o.newReplay, model: o.model, blocks: o.blocks,
		blockSize: o.blockSize, bufMax: o.bufMax}
	e.open("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","owned_by":"vllm"}]}`, e.model)
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n")
		fmt.Fprintf(w, "vllm:cache_config_info{block_size=\"%d\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"%d\",num_gpu_blocks_override=\"None\"} 1.0\n", e.blockSize, e.blocks)
		fmt.Fprintf(w, "vllm:num_requests_running{engine=\"0\",model_name=%q} 0.0\n", e.model)
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":16,"completion_tokens":1,"total_tokens":17}}`, e.model)
	})
	e.http = httptest.NewServer(mux)
	t.Cleanup(func() {
		e.http.Close()
		e.close()
	})
	return e
}

func (e *fakeEngine) open(pubEP, rtrEP string) {
	e.ctx, e.cancel = context.WithCancel(context.Background())
	e.pub = zmq4.NewPub(e.ctx, zmq4.WithLogger(quietZMQ))
	e.rtr = zmq4.NewRouter(e.ctx, zmq4.WithLogger(quietZMQ))
	var err error
	for try := 0; try < 50; try++ { // a restarted engine rebinds its ports
		if err = e.pub.Listen(pubEP); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		e.t.Fatal(err)
	}
	for try := 0; try < 50; try++ {
		if err = e.rtr.Listen(rtrEP); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		e.t.Fatal(err)
	}
	e.pubAddr = "tcp://" + e.pub.Addr().String()
	e.rtrAddr = "tcp://" + e.rtr.Addr().String()
	e.done = make(chan struct{})
	go e.serveReplay(e.ctx, e.rtr, e.done)
}

func (e *fakeEngine) noteErr(err error) {
	e.mu.Lock()
	e.errs = append(e.errs, err)
	e.mu.Unlock()
}

func (e *fakeEngine) close() {
	e.mu.Lock()
	cancel, pub, rtr, done := e.cancel, e.pub, e.rtr, e.done
	e.mu.Unlock()
	cancel()
	_ = pub.Close()
	_ = rtr.Close()
	<-done
}

// restart stops the engine and starts it again on the same ports: empty
// cache, sequence numbers from 0, empty replay buffer.
func (e *fakeEngine) restart() {
	e.close()
	e.mu.Lock()
	e.seq, e.buffer = 0, nil
	pubEP, rtrEP := e.pubAddr, e.rtrAddr
	e.mu.Unlock()
	e.open(pubEP, rtrEP)
}

func (e *fakeEngine) serveReplay(ctx context.Context, rtr zmq4.Socket, done chan struct{}) {
	defer close(done)
	for {
		msg, err := rtr.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			e.noteErr(fmt.Errorf("replay recv: %w", err))
			continue
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue // vLLM logs and ignores malformed requests
		}
		id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		e.mu.Lock()
		e.requests = append(e.requests, start)
		buf := append([]Frame(nil), e.buffer...)
		e.mu.Unlock()
		end := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
		for _, f := range buf {
			if f.Seq < start {
				continue
			}
			var seq [8]byte
			binary.BigEndian.PutUint64(seq[:], f.Seq)
			reply := zmq4.NewMsgFrom(id, []byte{}, seq[:], f.Payload)
			if e.newReplay {
				reply = zmq4.NewMsgFrom(id, []byte{}, []byte(e.topic), seq[:], f.Payload)
			}
			if err := rtr.Send(reply); err != nil {
				e.noteErr(fmt.Errorf("replay send: %w", err)) // vLLM logs and goes on
				break
			}
		}
		final := zmq4.NewMsgFrom(id, []byte{}, end, []byte{})
		if e.newReplay {
			final = zmq4.NewMsgFrom(id, []byte{}, []byte{}, end, []byte{})
		}
		if err := rtr.Send(final); err != nil {
			e.noteErr(fmt.Errorf("replay send end: %w", err))
		}
	}
}

// publish sends the next batch; dropped batches go to the replay buffer
// only (as when the PUB socket's high-water mark drops them).
func (e *fakeEngine) publish(payload []byte, dropped bool) uint64 {
	e.mu.Lock()
	seq := e.seq
	e.seq++
	e.buffer = append(e.buffer, Frame{Seq: seq, Payload: payload})
	if len(e.buffer) > e.bufMax {
		e.buffer = e.buffer[len(e.buffer)-e.bufMax:]
	}
	pub := e.pub
	e.mu.Unlock()
	if !dropped {
		var s [8]byte
		binary.BigEndian.PutUint64(s[:], seq)
		if err := pub.Send(zmq4.NewMsgFrom([]byte(e.topic), s[:], payload)); err != nil {
			e.t.Errorf("publish: %v", err)
		}
	}
	return seq
}

// sendRaw sends arbitrary frames on the PUB socket.
func (e *fakeEngine) sendRaw(frames ...[]byte) {
	e.mu.Lock()
	pub := e.pub
	e.mu.Unlock()
	if err := pub.Send(zmq4.NewMsgFrom(frames...)); err != nil {
		e.t.Errorf("send: %v", err)
	}
}

// waitSubscribed waits until a subscriber is connected (ZMQ's slow joiner:
// a PUB socket drops what it sends before the subscription arrives).
func (e *fakeEngine) waitSubscribed(t *testing.T) {
	t.Helper()
	poll.Until(t, 10*time.Second, 10*time.Millisecond, func() error {
		e.mu.Lock()
		pub := e.pub
		e.mu.Unlock()
		if len(pub.(zmq4.Topics).Topics()) == 0 {
			return fmt.Errorf("no subscriber on %s", e.pubAddr)
		}
		return nil
	})
}

func (e *fakeEngine) replayRequests() []uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]uint64(nil), e.requests...)
}

func (e *fakeEngine) url() string { return e.http.URL }

// fakePublisher is a Publisher that numbers events like eventbus's and
// applies them to an index, as the cluster would.
type fakePublisher struct {
	mu     sync.Mutex
	worker string
	rank   uint32
	next   uint64
	events []eventbus.WireEvent
	ix     *router.Index
	errs   []error
	closed bool
}

func (p *fakePublisher) PublishAsync(_ context.Context, ev eventbus.WireEvent) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, eventbus.ErrPublisherClosed
	}
	ev.Worker, ev.DPRank, ev.EventID = p.worker, p.rank, p.next
	if err := eventbus.Validate(&ev, 0); err != nil {
		return 0, err
	}
	p.next++
	p.events = append(p.events, ev)
	if err := p.ix.Apply(ev.WorkerID(), ev.KVEvent()); err != nil {
		p.errs = append(p.errs, err)
	}
	return ev.EventID, nil
}

func (p *fakePublisher) NextEventID() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next
}

func (p *fakePublisher) Flush(context.Context) error { return nil }

func (p *fakePublisher) Close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
}

// fakeCluster hands out fakePublishers over one shared index.
type fakeCluster struct {
	mu   sync.Mutex
	ix   *router.Index
	pubs map[router.WorkerID]*fakePublisher
}

func newFakeCluster() *fakeCluster {
	return &fakeCluster{ix: router.NewIndex(16), pubs: map[router.WorkerID]*fakePublisher{}}
}

func (c *fakeCluster) factory(worker string, rank uint32) (Publisher, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id := router.WorkerKey(worker, rank)
	c.ix.AddWorker(id)
	p := &fakePublisher{worker: worker, rank: rank, next: 1, ix: c.ix}
	c.pubs[id] = p
	return p, nil
}

func (c *fakeCluster) publisher(id router.WorkerID) *fakePublisher {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.pubs[id]
}

// contents is the content hashes the index holds for worker id.
func (c *fakeCluster) contents(id router.WorkerID) map[uint64]bool {
	out := map[uint64]bool{}
	for _, b := range c.ix.WorkerBlocks(id) {
		out[b.ContentHash] = true
	}
	return out
}

// fakeReplica records registrations.
type fakeReplica struct {
	mu      sync.Mutex
	regs    []registrar.Spec
	deregs  []string
	srv     *httptest.Server
	token   string
	refuses bool
}

func startFakeReplica(t *testing.T, token string) *fakeReplica {
	r := &fakeReplica{token: token}
	mux := http.NewServeMux()
	check := func(w http.ResponseWriter, req *http.Request) bool {
		if r.token != "" && req.Header.Get("Authorization") != "Bearer "+r.token {
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return false
		}
		return true
	}
	mux.HandleFunc("POST /workers/register", func(w http.ResponseWriter, req *http.Request) {
		if !check(w, req) {
			return
		}
		var spec registrar.Spec
		if err := json.NewDecoder(req.Body).Decode(&spec); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.mu.Lock()
		r.regs = append(r.regs, spec)
		r.mu.Unlock()
		fmt.Fprintf(w, `{"registered":%q}`, spec.ID)
	})
	mux.HandleFunc("POST /workers/deregister", func(w http.ResponseWriter, req *http.Request) {
		if !check(w, req) {
			return
		}
		var body struct{ ID string }
		_ = json.NewDecoder(req.Body).Decode(&body)
		r.mu.Lock()
		r.deregs = append(r.deregs, body.ID)
		r.mu.Unlock()
		fmt.Fprintf(w, `{}`)
	})
	r.srv = httptest.NewServer(mux)
	t.Cleanup(r.srv.Close)
	return r
}

func (r *fakeReplica) last(id string) (registrar.Spec, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := len(r.regs) - 1; i >= 0; i-- {
		if r.regs[i].ID == id {
			return r.regs[i], true
		}
	}
	return registrar.Spec{}, false
}

func freeTCPAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

var _ = strings.TrimSpace
