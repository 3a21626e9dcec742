// Tests of the Go binding against the real libctr: training lowers the loss,
// a checkpoint restores the exact trajectory, errors carry the library's
// status and message, and handles close in any order without leaks.
//
// Needs libctr to build and run (pkg-config or -tags ctr_nopkgconfig with
// CGO_CFLAGS/CGO_LDFLAGS, and LD_LIBRARY_PATH); tests/bindings/run_go.sh sets
// all of it.

package ctr

import (
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
)

const (
	testSeq   = 64
	testBatch = 4
)

func testGraph(t *testing.T) *Graph {
	t.Helper()
	g, err := NewPresetGraph("gpt", NewOptions().
		SetInt("layers", 2).SetInt("dim", 64).SetInt("heads", 4).
		SetInt("vocab", 256).SetInt("seq", testSeq))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	return g
}

func testMesh(t *testing.T) *Mesh {
	t.Helper()
	m, err := NewMesh(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func stepOptions() *Options {
	return NewOptions().SetInt("batch", testBatch).SetInt("seed", 1).
		SetFloat("lr", 3e-3).SetInt("warmup_steps", 2).SetInt("decay_steps", 20)
}

func testLoader(t *testing.T) *Loader {
	t.Helper()
	l, err := NewBuiltinLoader(NewOptions().SetInt("seq", testSeq).SetInt("seed", 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func newStep(t *testing.T, m *Mesh, g *Graph, o *Options) *Step {
	t.Helper()
	s, err := NewStep(m, g, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// wantStatus fails unless err is an *Error with the given status.
func wantStatus(t *testing.T, err error, want Status) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("want a *ctr.Error with status %q, got %v", want, err)
	}
	if e.Status != want {
		t.Fatalf("want status %q, got %q: %s", want, e.Status, e.Message)
	}
	if e.Name != want.String() || e.Message == "" {
		t.Fatalf("error lacks its name or message: %#v", e)
	}
	return e
}

func TestABIAndVersion(t *testing.T) {
	if err := CheckABI(); err != nil {
		t.Fatal(err)
	}
	if ABIVersionLoaded() != ABIVersion {
		t.Fatalf("ABI %d, want %d", ABIVersionLoaded(), ABIVersion)
	}
	if len(strings.Split(Version(), ".")) != 3 {
		t.Fatalf("version %q", Version())
	}
	if StatusInvalidGraph.String() != "invalid graph" || DTypeF32.Size() != 4 {
		t.Fatal("status names or dtype sizes do not match the library")
	}
}

// testProfile is a cluster profile for the planner: two devices per host.
const testProfile = `{"name": "t", "devices_per_host": 2, "device": {"name": "core", "memory_bytes": 17179869184, "flops": 1e11, "bytes_per_s": 1e10, "launch_us": 5}, "links": {"host": {"latency_us": 3, "bytes_per_s": 4e9}, "network": {"latency_us": 50, "bytes_per_s": 1e8}}}`

func TestPlanRanksTheLayouts(t *testing.T) {
	g := testGraph(t)
	text, err := g.Plan(NewOptions().SetInt("world", 2).SetInt("global_batch", 4).SetString("cluster", testProfile))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(text, `"mesh":"fsdp=2"`) || !strings.Contains(text, `"step_ms"`) {
		t.Fatalf("plan: %s", text)
	}
	_, err = g.Plan(NewOptions().SetInt("world", 2).SetInt("global_batch", 4))
	if e := wantStatus(t, err, StatusInvalidOption); !strings.Contains(e.Message, "'cluster'") {
		t.Fatalf("error: %v", e)
	}
}

func TestGraphAndMesh(t *testing.T) {
	g := testGraph(t)
	inputs, err := g.InputNames()
	if err != nil || strings.Join(inputs, ",") != "tokens,targets" {
		t.Fatalf("inputs %v, %v", inputs, err)
	}
	params, err := g.ParamNames()
	if err != nil || len(params) == 0 {
		t.Fatalf("params %v, %v", params, err)
	}
	var total int64
	for _, p := range params {
		info, err := g.TensorInfo(p)
		if err != nil {
			t.Fatal(err)
		}
		total += info.NumElements()
	}
	if count, err := g.ParamCount(); err != nil || count != total {
		t.Fatalf("param count %d (%v), sum of shapes %d", count, err, total)
	}
	if info, err := g.TensorInfo("tokens"); err != nil || info.DType != DTypeI32 {
		t.Fatalf("tokens: %+v, %v", info, err)
	}
	if f, err := g.FlopsPerToken(0); err != nil || f <= 0 {
		t.Fatalf("flops %v, %v", f, err)
	}

	path := filepath.Join(t.TempDir(), "g.ctrg")
	if err := g.SaveFile(path); err != nil {
		t.Fatal(err)
	}
	g2, err := LoadGraphFile(path)
	if err != nil {
		t.Fatal(err)
	}
	defer g2.Close()
	data, _ := os.ReadFile(path)
	g3, err := LoadGraphBuffer(data)
	if err != nil {
		t.Fatal(err)
	}
	defer g3.Close()
	if c2, _ := g3.ParamCount(); c2 != total {
		t.Fatalf("reloaded graph has %d params, want %d", c2, total)
	}

	m := testMesh(t)
	if m.Rank() != 0 || m.WorldSize() != 1 || m.Device() != "cpu" || m.AxisSize("dp") != 1 {
		t.Fatalf("mesh rank %d world %d device %q", m.Rank(), m.WorldSize(), m.Device())
	}
	// Host collectives on one rank: the group is this rank alone.
	if me, members, err := m.Group("world"); err != nil || me != 0 || len(members) != 1 || members[0] != 0 {
		t.Fatalf("group: %d %v %v", me, members, err)
	}
	x := []float64{1.5, -2}
	if err := m.AllReduceFloat64("world", x, "sum"); err != nil || x[0] != 1.5 || x[1] != -2 {
		t.Fatalf("all_reduce: %v %v", x, err)
	}
	if out, err := m.AllGatherBytes("world", []byte{7, 8}); err != nil || string(out) != "\x07\x08" {
		t.Fatalf("all_gather: %v %v", out, err)
	}
	if err := m.Barrier("world"); err != nil {
		t.Fatal(err)
	}
	if err := m.AllReduceFloat64("xp", x, "sum"); err == nil || !strings.Contains(err.Error(), "no axis 'xp'") {
		t.Fatalf("an unknown axis: %v", err)
	}
	if d, err := m.Describe(); err != nil || !strings.Contains(d, `"world":1`) {
		t.Fatalf("describe: %q %v", d, err)
	}
}

func TestTenStepsLowerTheLoss(t *testing.T) {
	s := newStep(t, testMesh(t), testGraph(t), stepOptions())
	mem, err := s.Memory()
	if err != nil || mem.ArenaBytes <= 0 || mem.ParamBytes <= 0 || mem.OptimizerBytes <= 0 {
		t.Fatalf("memory %+v, %v", mem, err)
	}
	if err := s.AttachLoader(testLoader(t)); err != nil {
		t.Fatal(err)
	}
	var losses []float64
	for i := 1; i <= 10; i++ {
		if err := s.FeedFromLoader(testBatch); err != nil {
			t.Fatal(err)
		}
		m, err := s.Run()
		if err != nil {
			t.Fatal(err)
		}
		if m.Step != int64(i) || m.Tokens != testBatch*testSeq || math.IsNaN(m.Loss) || math.IsInf(m.Loss, 0) {
			t.Fatalf("step %d: %+v", i, m)
		}
		// One rank: no collectives, so compute is the forward and backward time.
		if !(m.ComputeMs > 0 && m.ComputeMs <= m.StepMs) || m.CommMs < 0 || m.ExposedCommMs < 0 || m.SaveWaitMs < 0 {
			t.Fatalf("step %d: times %+v", i, m)
		}
		losses = append(losses, m.Loss)
	}
	if math.Abs(losses[0]-math.Log(256)) > 0.5 || !(losses[9] < losses[0]-0.1) {
		t.Fatalf("loss did not fall from ln(256): %v", losses)
	}
	if s.Count() != 10 {
		t.Fatalf("count %d", s.Count())
	}
	if l, err := s.Evaluate(); err != nil || math.IsNaN(l) || s.Count() != 10 {
		t.Fatalf("evaluate %v, %v, count %d", l, err, s.Count())
	}
}

func TestMoEMetricsCountTheTokensOfEachExpert(t *testing.T) {
	g, err := NewPresetGraph("moe", NewOptions().
		SetInt("layers", 1).SetInt("dim", 32).SetInt("heads", 4).SetInt("kv_heads", 2).
		SetInt("vocab", 256).SetInt("seq", 16).SetInt("experts", 4).SetInt("top_k", 2).SetInt("ffn_dim", 32))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })
	m := testMesh(t)
	if m.DataRank() != 0 || m.DataSize() != 1 {
		t.Fatalf("one rank's data share: %d of %d", m.DataRank(), m.DataSize())
	}
	s := newStep(t, m, g, NewOptions().SetInt("batch", 2).SetInt("seq", 16))
	if layers, err := s.MoEMetrics(); err != nil || len(layers) != 0 {
		t.Fatalf("before a run: %v, %v", layers, err)
	}
	if layers, err := s.MoELayers(); err != nil || len(layers) != 0 {
		t.Fatalf("struct call before a run: %v, %v", layers, err)
	}
	ids := make([]int32, 32)
	for i := range ids {
		ids[i] = int32(i)
	}
	if err := s.SetInput("tokens", ids); err != nil {
		t.Fatal(err)
	}
	if err := s.SetInput("targets", ids); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Run(); err != nil {
		t.Fatal(err)
	}
	// One rank: no collective runs.
	if axes, err := s.CommMetrics(); err != nil || len(axes) != 0 {
		t.Fatalf("comm metrics on one rank: %v, %v", axes, err)
	}
	layers, err := s.MoEMetrics()
	if err != nil || len(layers) != 1 || layers[0].Layer != "layers.0.moe" || len(layers[0].TokensPerExpert) != 4 {
		t.Fatalf("moe metrics %+v, %v", layers, err)
	}
	var total int64
	for _, n := range layers[0].TokensPerExpert {
		total += n
	}
	// Every token picks 2 of the 4 experts.
	if total != 64 || !(layers[0].AuxLoss > 0) || !(layers[0].ZLoss > 0) || layers[0].Experts != 4 {
		t.Fatalf("moe metrics %+v", layers[0])
	}
	// The struct call reports the same, bit for bit.
	structs, err := s.MoELayers()
	if err != nil || len(structs) != 1 || structs[0].Experts != 4 {
		t.Fatalf("moe layers %+v, %v", structs, err)
	}
	total = 0
	for _, n := range structs[0].TokensPerExpert {
		total += n
	}
	if total != 64 || !reflect.DeepEqual(structs, layers) {
		t.Fatalf("moe layers %+v, json %+v", structs, layers)
	}
	// The copies outlive the step's next call and the step itself.
	s.Run()
	s.Close()
	if !reflect.DeepEqual(structs, layers) {
		t.Fatalf("moe layers changed after the step's next run: %+v", structs)
	}
	if _, err := s.MoELayers(); StatusOf(err) != StatusInvalidState {
		t.Fatalf("closed step: %v", err)
	}

	// A loss the layer lacks is NaN in the struct call, absent (0) in the JSON.
	g2, err := NewPresetGraph("moe", NewOptions().
		SetInt("layers", 2).SetInt("dim", 32).SetInt("heads", 4).SetInt("kv_heads", 2).
		SetInt("vocab", 256).SetInt("seq", 16).SetInt("experts", 4).SetInt("top_k", 2).SetInt("ffn_dim", 32).
		SetFloat("z_loss", 0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g2.Close() })
	s2 := newStep(t, m, g2, NewOptions().SetInt("batch", 2).SetInt("seq", 16))
	s2.SetInput("tokens", ids)
	s2.SetInput("targets", ids)
	if _, err := s2.Run(); err != nil {
		t.Fatal(err)
	}
	layers, err = s2.MoEMetrics()
	if err != nil {
		t.Fatal(err)
	}
	structs, err = s2.MoELayers()
	if err != nil || len(structs) != 2 || len(layers) != 2 {
		t.Fatalf("moe layers %+v, %v; json %+v", structs, err, layers)
	}
	for i, l := range structs {
		want := layers[i]
		if l.Layer != want.Layer || !reflect.DeepEqual(l.TokensPerExpert, want.TokensPerExpert) ||
			l.AuxLoss != want.AuxLoss || !(l.AuxLoss > 0) || !math.IsNaN(l.ZLoss) || want.ZLoss != 0 {
			t.Fatalf("layer %d: struct %+v, json %+v", i, l, want)
		}
	}
	if structs[1].Layer != "layers.1.moe" {
		t.Fatalf("graph order: %+v", structs)
	}
}

func TestCheckpointRestoresTheTrajectory(t *testing.T) {
	m, g := testMesh(t), testGraph(t)
	dir := t.TempDir()
	ckpt := filepath.Join(dir, "step3")
	params, _ := g.ParamNames()

	a := newStep(t, m, g, stepOptions())
	if err := a.AttachLoader(testLoader(t)); err != nil {
		t.Fatal(err)
	}
	train := func(s *Step, n int) []float64 {
		var out []float64
		for i := 0; i < n; i++ {
			if err := s.FeedFromLoader(testBatch); err != nil {
				t.Fatal(err)
			}
			r, err := s.Run()
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, r.Loss)
		}
		return out
	}
	train(a, 3)
	if err := a.Save(ckpt); err != nil {
		t.Fatal(err)
	}
	saved, err := a.Param(params[0])
	if err != nil {
		t.Fatal(err)
	}
	want := train(a, 3)

	// Other initial weights and a fresh loader; the checkpoint brings back
	// weights, optimizer state, schedule and data position.
	b := newStep(t, m, g, stepOptions().SetInt("seed", 99))
	if err := b.AttachLoader(testLoader(t)); err != nil {
		t.Fatal(err)
	}
	if err := b.Load(ckpt); err != nil {
		t.Fatal(err)
	}
	if b.Count() != 3 {
		t.Fatalf("count after load %d", b.Count())
	}
	got, _ := b.Param(params[0])
	for i := range saved {
		if got[i] != saved[i] {
			t.Fatalf("%s[%d] = %v after load, saved %v", params[0], i, got[i], saved[i])
		}
	}
	if resumed := train(b, 3); !equal(resumed, want) {
		t.Fatalf("resumed losses %v, want %v", resumed, want)
	}

	e := wantStatus(t, b.Load(filepath.Join(dir, "missing")), StatusCheckpointError)
	if !strings.Contains(e.Message, "missing") {
		t.Fatalf("message does not name the directory: %s", e.Message)
	}
	if b.Count() != 6 {
		t.Fatalf("a failed load changed the step: count %d", b.Count())
	}
	if err := b.AttachLoader(nil); err != nil || b.Loader() != nil {
		t.Fatalf("detach: %v", err)
	}
}

// trainSteps runs n steps fed from the step's loader and returns the losses.
func trainSteps(t *testing.T, s *Step, n int) []float64 {
	t.Helper()
	var out []float64
	for i := 0; i < n; i++ {
		if err := s.FeedFromLoader(testBatch); err != nil {
			t.Fatal(err)
		}
		r, err := s.Run()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, r.Loss)
	}
	return out
}

func readLatest(t *testing.T, root string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "latest"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func TestCheckpointDirectoryKeepsTheNewestAndResumesExactly(t *testing.T) {
	m, g := testMesh(t), testGraph(t)
	root := filepath.Join(t.TempDir(), "ckpts")
	keep1 := NewOptions().SetInt("keep", 1)

	a := newStep(t, m, g, stepOptions())
	if err := a.AttachLoader(testLoader(t)); err != nil {
		t.Fatal(err)
	}
	trainSteps(t, a, 2)
	if p, err := a.SaveCheckpoint(root, keep1); err != nil || p != filepath.Join(root, "step_00000002") {
		t.Fatalf("first save: %q, %v", p, err)
	}
	if l := readLatest(t, root); l != "step_00000002" {
		t.Fatalf("latest %q", l)
	}
	trainSteps(t, a, 2)
	path, err := a.SaveCheckpoint(root, keep1)
	if err != nil || path != filepath.Join(root, "step_00000004") {
		t.Fatalf("second save: %q, %v", path, err)
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if strings.Join(names, ",") != "latest,step_00000004" {
		t.Fatalf("after keep=1: %v", names)
	}
	if l := readLatest(t, root); l != "step_00000004" {
		t.Fatalf("latest %q", l)
	}
	want := trainSteps(t, a, 3)
	_, err = a.SaveCheckpoint(root, NewOptions().SetInt("keep_last", 2))
	if e := wantStatus(t, err, StatusInvalidOption); !strings.Contains(e.Message, "keep_last") {
		t.Fatalf("message does not name the key: %s", e.Message)
	}

	// Another seed and a fresh loader: latest brings back weights, optimizer
	// state, schedule and data position, so the losses match bit for bit.
	b := newStep(t, m, g, stepOptions().SetInt("seed", 99))
	if err := b.AttachLoader(testLoader(t)); err != nil {
		t.Fatal(err)
	}
	r, err := b.Resume(root, "")
	if err != nil || r.Path != path || len(r.Skipped) != 0 {
		t.Fatalf("resume: %+v, %v", r, err)
	}
	if b.Count() != 4 {
		t.Fatalf("count after resume %d", b.Count())
	}
	if got := trainSteps(t, b, 3); !equal(got, want) {
		t.Fatalf("resumed losses %v, want %v", got, want)
	}
	if r, err := b.Resume(root, "step_00000004"); err != nil || r.Path != path {
		t.Fatalf("resume by name: %+v, %v", r, err)
	}
}

func TestCheckpointDirectoryFallsBackPastADamagedCheckpoint(t *testing.T) {
	m, g := testMesh(t), testGraph(t)
	dir := t.TempDir()
	root := filepath.Join(dir, "ckpts")
	keep2 := NewOptions().SetInt("keep", 2)

	a := newStep(t, m, g, stepOptions())
	if err := a.AttachLoader(testLoader(t)); err != nil {
		t.Fatal(err)
	}
	trainSteps(t, a, 2)
	older, err := a.SaveCheckpoint(root, keep2)
	if err != nil {
		t.Fatal(err)
	}
	trainSteps(t, a, 2)
	newest, err := a.SaveCheckpoint(root, keep2)
	if err != nil {
		t.Fatal(err)
	}
	shard := filepath.Join(newest, "rank00000.bin")
	data, err := os.ReadFile(shard)
	if err != nil {
		t.Fatal(err)
	}
	data[100] ^= 0x01
	if err := os.WriteFile(shard, data, 0o644); err != nil {
		t.Fatal(err)
	}

	b := newStep(t, m, g, stepOptions())
	r, err := b.Resume(root, "latest")
	if err != nil || r.Path != older {
		t.Fatalf("resume: %+v, %v; want %s", r, err, older)
	}
	if len(r.Skipped) != 1 || !strings.HasPrefix(r.Skipped[0], newest+": ") ||
		!strings.Contains(r.Skipped[0], "checksum mismatch") {
		t.Fatalf("skipped %q", r.Skipped)
	}
	if b.Count() != 2 {
		t.Fatalf("count after fallback %d", b.Count())
	}

	// Named explicitly, the damaged one is an error and the step keeps its state.
	_, err = b.Resume(root, newest)
	if e := wantStatus(t, err, StatusCheckpointError); !strings.Contains(e.Message, "rank00000.bin") {
		t.Fatalf("message does not name the file: %s", e.Message)
	}

	// No checkpoint at all: StatusNotFound naming the directory.
	empty := filepath.Join(dir, "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	_, err = b.Resume(empty, "")
	if e := wantStatus(t, err, StatusNotFound); !strings.Contains(e.Message, empty) {
		t.Fatalf("message does not name the directory: %s", e.Message)
	}
	_, err = b.Resume(filepath.Join(dir, "absent"), "")
	wantStatus(t, err, StatusNotFound)
	if b.Count() != 2 {
		t.Fatalf("a failed resume changed the step: count %d", b.Count())
	}
}

func equal(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Two "ranks" reading halves of each global batch see exactly the rows a
// single reader of the whole batch sees, and stay in step with it.
func TestLoaderSlicesMatchTheGlobalBatch(t *testing.T) {
	whole, r0, r1 := testLoader(t), testLoader(t), testLoader(t)
	half := 2 * testSeq
	for i := 0; i < 3; i++ {
		tokens, targets, err := whole.NextBatch(4)
		if err != nil {
			t.Fatal(err)
		}
		t0, g0 := make([]int32, half), make([]int32, half)
		t1, g1 := make([]int32, half), make([]int32, half)
		if err := r0.NextSlice(4, 0, t0, g0); err != nil {
			t.Fatal(err)
		}
		if err := r1.NextSlice(4, 2, t1, g1); err != nil {
			t.Fatal(err)
		}
		for j := 0; j < half; j++ {
			if t0[j] != tokens[j] || t1[j] != tokens[half+j] || g0[j] != targets[j] || g1[j] != targets[half+j] {
				t.Fatalf("batch %d: slices differ from the global batch at %d", i, j)
			}
		}
	}
	// A rank that reads no rows still advances with the others.
	if err := r0.NextSlice(4, 4, nil, nil); err != nil {
		t.Fatal(err)
	}
	whole.NextBatch(4)
	a, _, _ := r0.NextBatch(1)
	b, _, _ := whole.NextBatch(1)
	for j := range a {
		if a[j] != b[j] {
			t.Fatal("a rank that read no rows fell out of step")
		}
	}
	wantStatus(t, r1.NextSlice(4, 3, make([]int32, half), make([]int32, half)), StatusInvalidArgument)
}

// tokenInfo is the JSON of Tokens.Info.
type tokenInfo struct {
	Name   string `json:"name"`
	Kind   string `json:"kind"`
	Tokens int64  `json:"tokens"`
	MaxID  int64  `json:"max_id"`
	Files  []struct {
		Path        string `json:"path"`
		Tokens      int64  `json:"tokens"`
		Width       int    `json:"width"`
		HeaderBytes int64  `json:"header_bytes"`
	} `json:"files"`
}

func openInfo(t *testing.T, path string, opts *Options) (*Tokens, tokenInfo) {
	t.Helper()
	tok, err := OpenTokens(path, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tok.Close() })
	text, err := tok.Info()
	if err != nil {
		t.Fatal(err)
	}
	var info tokenInfo
	if err := json.Unmarshal([]byte(text), &info); err != nil {
		t.Fatalf("%v: %s", err, text)
	}
	return tok, info
}

func writeTokens(t *testing.T, path, format string, width int, ids []uint32) {
	t.Helper()
	w, err := CreateTokenWriter(path, format, width, int64(len(ids)))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	// In two parts: a file is written in any number of calls.
	half := len(ids) / 2
	if err := w.Write(ids[:half]); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ids[half:]); err != nil {
		t.Fatal(err)
	}
	if err := w.Finish(); err != nil {
		t.Fatal(err)
	}
}

// Token files written by TokenWriter are read back by Tokens as the loader
// reads them; a manifest's sub-datasets open one at a time.
func TestTokenFilesWrittenAndReadAsTheLoaderReadsThem(t *testing.T) {
	dir := t.TempDir()
	ids := make([]uint32, 1000)
	for i := range ids {
		ids[i] = uint32(i % 300)
	}
	a, b := filepath.Join(dir, "a.bin"), filepath.Join(dir, "b.npy")
	writeTokens(t, a, "llmc", 2, ids)
	writeTokens(t, b, "npy", 4, ids[:500])

	tok, info := openInfo(t, a, nil)
	if info.Tokens != 1000 || info.MaxID != 299 || !strings.Contains(info.Kind, "llm.c") || len(info.Files) != 1 ||
		info.Files[0].Width != 2 || info.Files[0].HeaderBytes != 1024 {
		t.Fatalf("info %+v", info)
	}
	if got, err := tok.Read(295, 10); err != nil ||
		!reflect.DeepEqual(got, []uint32{295, 296, 297, 298, 299, 0, 1, 2, 3, 4}) {
		t.Fatalf("read %v, %v", got, err)
	}
	if got, err := tok.Read(0, 1000); err != nil || !reflect.DeepEqual(got, ids) {
		t.Fatalf("read all: %v", err)
	}
	if got, err := tok.Read(1000, 0); err != nil || len(got) != 0 {
		t.Fatalf("read none: %v, %v", got, err)
	}
	// Windows of seq + 1 tokens that share their boundary token.
	if n, err := tok.Samples(16, "windows", -1); err != nil || n != (1000-1)/16 {
		t.Fatalf("windows %d, %v", n, err)
	}
	if n, err := tok.Samples(16, "", -1); err != nil || n != (1000-1)/16 {
		t.Fatalf("default mode %d, %v", n, err)
	}
	if n, err := tok.Samples(16, "documents", 299); err != nil || n <= 0 {
		t.Fatalf("documents %d, %v", n, err)
	}
	if e := wantStatus(t, ignore(tok.Read(995, 10)), StatusInvalidArgument); !strings.Contains(e.Message, "[995, 1005) of 1000") {
		t.Fatal(e)
	}
	wantStatus(t, ignore(tok.Read(0, -1)), StatusInvalidArgument)
	wantStatus(t, ignore(tok.Samples(5000, "windows", -1)), StatusDataError)
	wantStatus(t, ignore(tok.Samples(16, "lines", -1)), StatusInvalidArgument)

	// A manifest of both files.
	m := filepath.Join(dir, "m.json")
	manifest := `{"datasets": [{"name": "x", "files": ["a.bin"], "weight": 3}, {"name": "y", "files": ["b.npy"]}]}`
	if err := os.WriteFile(m, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	text, err := ManifestInfo(m)
	if err != nil {
		t.Fatal(err)
	}
	var mi struct {
		Mode     *string `json:"mode"`
		Datasets []struct {
			Name   string   `json:"name"`
			Weight float64  `json:"weight"`
			Files  []string `json:"files"`
		} `json:"datasets"`
	}
	if err := json.Unmarshal([]byte(text), &mi); err != nil {
		t.Fatalf("%v: %s", err, text)
	}
	if len(mi.Datasets) != 2 || mi.Datasets[0].Name != "x" || mi.Datasets[1].Name != "y" ||
		mi.Datasets[0].Weight != 3 || mi.Mode != nil {
		t.Fatalf("manifest %s", text)
	}
	if e := wantStatus(t, ignore(OpenTokens(m, nil)), StatusInvalidArgument); !strings.Contains(e.Message, "option 'dataset'") {
		t.Fatal(e)
	}
	if _, y := openInfo(t, m, NewOptions().SetInt("dataset", 1)); y.Tokens != 500 || y.Files[0].Width != 4 {
		t.Fatalf("dataset y %+v", y)
	}
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"datasets": []}`), 0o644)
	wantStatus(t, ignore(ManifestInfo(bad)), StatusDataError)
	wantStatus(t, ignore(OpenTokens(filepath.Join(dir, "none.bin"), nil)), StatusIOError)

	tok.Close()
	tok.Close()
	if _, err := tok.Read(0, 1); StatusOf(err) != StatusInvalidState {
		t.Fatalf("closed tokens: %v", err)
	}
}

// ignore drops a result to pass a call's error on.
func ignore[T any](_ T, err error) error { return err }

// A refused write names the id, and a writer closed unfinished leaves no file.
func TestTokenWriterRefusesAndCleansUp(t *testing.T) {
	dir := t.TempDir()
	c := filepath.Join(dir, "c.bin")
	w, err := CreateTokenWriter(c, "llmc", 2, 2)
	if err != nil {
		t.Fatal(err)
	}
	if e := wantStatus(t, w.Write([]uint32{7, 70000}), StatusDataError); !strings.Contains(e.Message, "70000") {
		t.Fatal(e)
	}
	if _, err := os.Stat(c + ".tmp"); err != nil {
		t.Fatalf("the unfinished file: %v", err)
	}
	w.Close()
	w.Close()
	if err := w.Write([]uint32{1}); StatusOf(err) != StatusInvalidState {
		t.Fatalf("closed writer: %v", err)
	}
	// Too few tokens, then closed unfinished.
	w, err = CreateTokenWriter(c, "u16", 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write([]uint32{1, 2}); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, w.Finish(), StatusDataError)
	w.Close()
	if left, _ := filepath.Glob(c + "*"); len(left) != 0 {
		t.Fatalf("left behind: %v", left)
	}
	// A finished writer accepts no more tokens.
	w, err = CreateTokenWriter(c, "u32", 4, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Write([]uint32{70000}); err != nil {
		t.Fatal(err)
	}
	if err := w.Finish(); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, w.Write([]uint32{1}), StatusInvalidArgument)
	wantStatus(t, ignore(CreateTokenWriter(filepath.Join(dir, "d.bin"), "bytes", 1, 1)), StatusInvalidArgument)
	if _, info := openInfo(t, c, NewOptions().SetString("format", "u32")); info.Tokens != 1 || info.MaxID != 70000 {
		t.Fatalf("info %+v", info)
	}
}

func TestSafetensorsRoundTrip(t *testing.T) {
	m, g := testMesh(t), testGraph(t)
	path := filepath.Join(t.TempDir(), "w.safetensors")
	a := newStep(t, m, g, stepOptions())
	if err := a.ExportSafetensors(path); err != nil {
		t.Fatal(err)
	}
	b := newStep(t, m, g, stepOptions().SetInt("seed", 7))
	if err := b.ImportSafetensors(path, nil); err != nil {
		t.Fatal(err)
	}
	params, _ := g.ParamNames()
	for _, p := range params {
		x, _ := a.Param(p)
		y, _ := b.Param(p)
		for i := range x {
			if x[i] != y[i] {
				t.Fatalf("%s differs after import", p)
			}
		}
	}
}

func TestParamsAndOutputs(t *testing.T) {
	g := testGraph(t)
	s := newStep(t, testMesh(t), g, stepOptions().SetString("keep", "logits"))
	params, _ := g.ParamNames()
	w, err := s.Param(params[0])
	if err != nil {
		t.Fatal(err)
	}
	for i := range w {
		w[i] = 0.25
	}
	if err := s.SetParam(params[0], w); err != nil {
		t.Fatal(err)
	}
	if back, _ := s.Param(params[0]); back[0] != 0.25 || back[len(back)-1] != 0.25 {
		t.Fatal("SetParam did not stick")
	}
	tokens, targets, err := testLoader(t).NextBatch(testBatch)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SetInput("tokens", tokens); err != nil {
		t.Fatal(err)
	}
	if err := s.SetInput("targets", targets); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Run(); err != nil {
		t.Fatal(err)
	}
	logits := make([]float32, testBatch*testSeq*256)
	for i := range logits {
		logits[i] = float32(math.NaN())
	}
	if err := s.GetOutput("logits", logits); err != nil {
		t.Fatal(err)
	}
	for _, x := range logits {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			t.Fatal("logits not written")
		}
	}
	if err := s.SetLR(1e-4); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Run(); err != nil || math.Abs(r.LR-1e-4) > 1e-12 {
		t.Fatalf("lr %v, %v", r.LR, err)
	}
}

func TestErrorsCarryStatusAndMessage(t *testing.T) {
	_, err := LoadGraphFile("/nonexistent/dir/model.ctrg")
	e := wantStatus(t, err, StatusIOError)
	if !strings.Contains(e.Message, "/nonexistent/dir/model.ctrg") || e.Error() != "ctr: i/o error: "+e.Message {
		t.Fatalf("message %q", e.Error())
	}
	if !errors.Is(err, &Error{Status: StatusIOError}) {
		t.Fatal("errors.Is does not match on status")
	}

	junk := filepath.Join(t.TempDir(), "junk.ctrg")
	os.WriteFile(junk, []byte("definitely not a flatbuffer"), 0o644)
	_, err = LoadGraphFile(junk)
	wantStatus(t, err, StatusInvalidGraph)

	m, g := testMesh(t), testGraph(t)
	_, err = NewStep(m, g, stepOptions().SetInt("bacth", 4))
	if e := wantStatus(t, err, StatusInvalidOption); !strings.Contains(e.Message, "bacth") {
		t.Fatalf("message does not name the key: %s", e.Message)
	}
	_, err = NewStep(m, g, stepOptions().SetString("lr", "fast"))
	wantStatus(t, err, StatusInvalidOption)
	_, err = NewStep(m, g, nil)
	wantStatus(t, err, StatusInvalidOption)
	_, err = NewMesh(NewOptions().SetInt("ra\x00nk", 0))
	wantStatus(t, err, StatusInvalidArgument)
	if _, err := NewPresetGraph("resnet", nil); err == nil || !strings.Contains(err.Error(), "resnet") {
		t.Fatalf("unknown preset: %v", err)
	}

	s := newStep(t, m, g, stepOptions())
	_, err = s.Run()
	wantStatus(t, err, StatusInvalidState)
	wantStatus(t, s.SetInput("tokens", make([]int32, 3)), StatusInvalidArgument)
	bad := make([]int32, testBatch*testSeq)
	bad[5] = 256
	if e := wantStatus(t, s.SetInput("tokens", bad), StatusDataError); !strings.Contains(e.Message, "tokens") {
		t.Fatalf("message does not name the input: %s", e.Message)
	}
	wantStatus(t, s.SetInput("nope", bad), StatusNotFound)
	wantStatus(t, s.SetInput("tokens", []string{"a"}), StatusInvalidArgument)
	wantStatus(t, s.FeedFromLoader(testBatch), StatusInvalidState)

	l := testLoader(t)
	wantStatus(t, l.Next(2, make([]int32, 10), make([]int32, 10)), StatusInvalidArgument)
	_, err = NewBuiltinLoader(nil)
	wantStatus(t, err, StatusInvalidOption)

	ckpt := filepath.Join(t.TempDir(), "ckpt")
	if err := s.Save(ckpt); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(ckpt)
	for _, en := range entries {
		p := filepath.Join(ckpt, en.Name())
		b, _ := os.ReadFile(p)
		b[len(b)/2] ^= 0xff
		os.WriteFile(p, b, 0o644)
	}
	wantStatus(t, s.Load(ckpt), StatusCheckpointError)
}

// The error message is thread-local in C; failures on many goroutines at once
// must each get their own message (the binding pins the OS thread per call).
func TestErrorsFromManyGoroutines(t *testing.T) {
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			for j := 0; j < 50; j++ {
				path := filepath.Join("/nonexistent", strings.Repeat("x", i+1)+".ctrg")
				_, err := LoadGraphFile(path)
				if e, ok := err.(*Error); !ok || !strings.Contains(e.Message, path) {
					t.Errorf("goroutine %d: %v", i, err)
					return
				}
				runtime.Gosched()
			}
		}(i)
	}
	wg.Wait()
}

func TestCloseInAnyOrder(t *testing.T) {
	m, _ := NewMesh(nil)
	g, _ := NewPresetGraph("gpt", NewOptions().SetInt("layers", 1).SetInt("dim", 32).
		SetInt("heads", 2).SetInt("vocab", 256).SetInt("seq", testSeq))
	s, err := NewStep(m, g, stepOptions())
	if err != nil {
		t.Fatal(err)
	}
	l, _ := NewBuiltinLoader(NewOptions().SetInt("seq", testSeq))
	if err := s.AttachLoader(l); err != nil {
		t.Fatal(err)
	}
	params, _ := g.ParamNames()
	// Closing what the step depends on only marks it closed; the step still runs.
	m.Close()
	g.Close()
	l.Close()
	if _, err := NewStep(m, g, stepOptions()); err == nil {
		t.Fatal("NewStep accepted a closed mesh")
	}
	if _, err := g.ParamCount(); StatusOf(err) != StatusInvalidState {
		t.Fatalf("closed graph: %v", err)
	}
	if err := s.FeedFromLoader(testBatch); StatusOf(err) != StatusInvalidState {
		t.Fatalf("closed loader: %v", err)
	}
	if w, err := s.Param(params[0]); err != nil || len(w) == 0 {
		t.Fatalf("Param through a step whose graph the owner closed: %v", err)
	}
	tokens := make([]int32, testBatch*testSeq)
	s.SetInput("tokens", tokens)
	s.SetInput("targets", tokens)
	if _, err := s.Run(); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s.Close()
	if _, err := s.Run(); StatusOf(err) != StatusInvalidState {
		t.Fatalf("closed step: %v", err)
	}
	if s.Count() != -1 {
		t.Fatal("Count on a closed step")
	}

	// Handles dropped without Close are freed by their finalizers.
	for i := 0; i < 3; i++ {
		m, _ := NewMesh(nil)
		NewStep(m, testGraph(t), stepOptions())
	}
	runtime.GC()
	runtime.GC()
}
